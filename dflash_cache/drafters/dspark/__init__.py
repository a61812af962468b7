"""The DSpark family (arXiv 2607.05147; deepseek-ai/DeepSpec): DFlash's parallel block backbone,
a Markov head and a confidence head, trained with CE + L1 (total variation) + confidence BCE.

What the reference's code does, and this module with it (docs/reference/dspark.md; QUALITY.md has the check):

- **Blocks.** Slot 0 holds the anchor token, slots 1..B-1 the mask token, at positions anchor + k,
  as in DFlash; but slot k (k = 0..B-1) predicts the token at anchor + k + 1, so a block of B slots
  drafts B tokens (DFlash: B - 1). An anchor is a position p < len - 1 with loss_mask[p] and
  loss_mask[p + 1]; slot k is trained while anchor + k + 1 is inside the sequence and supervised,
  and only as a contiguous prefix (the reference's cumprod "eval mask"). Slot weights are
  exp(-k / gamma) on that prefix, gamma 4 by default.
- **Markov head** (`markov_rank` r > 0): slot k's logits get a bias W2(z_k), z_k a rank-r latent of
  the previous token (the one at anchor + k: the anchor for slot 0), teacher-forced in training
  and the token just drafted when decoding. `vanilla`: z = W1[prev]; `gated`: z = sigmoid(G [h_k;
  W1[prev]]) * W1[prev]; `rnn`: a GRU-like state over the block's slots, z = tanh(output).
- **Confidence head**: a linear map of [h_k; W1[prev]] (`confidence_head_with_markov`) or of h_k
  to a logit, trained with BCE against a = clamp(1 - |p_draft - p_target|_1 / 2, 0, 1), detached,
  where p_target at label position t is softmax(lm_head(h_last[t - 1])): the target's final hidden
  state, which the cache holds (`extract --final-hidden`).
- **Loss**: (ce_alpha CE + l1_alpha L1 + confidence_alpha BCE), each term a sum over trained slots
  weighted as above, over their summed weights; during training the denominator is summed across
  data-parallel ranks and the loss scaled by the world size (the reference's). Defaults: the
  reference's configs (block 7, r 256 vanilla, confidence with Markov, 0.1 / 0.9 / 1.0, gamma 4).

The export is DeepSpec's released-checkpoint layout, which vLLM's `dspark` method reads:
architectures ["Qwen3DSparkModel"], the target's geometry, top-level `block_size`,
`target_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`; weights `layers.*`, `fc`, `hidden_norm`, `norm`, `markov_head.*`,
`confidence_head.proj.*`, and the target's `embed_tokens` and `lm_head` copies, as the reference
saves them (vLLM takes the target's when they are absent).

`config.py` is the drafter's config and its serving config.json, `model.py` the heads and the
draft model, `objective.py` the blocks and the loss, `family.py` the rest of the family (its
`FAMILY`), `settings.py` its settings. `modeling_dspark.py` is the remote-code file every export
carries; the package never imports it. Light: importing the package loads no torch.
"""
