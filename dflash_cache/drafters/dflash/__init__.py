"""The DFlash family: the draft model, its objective, FLOPs count, serving export and draft head.

The drafter fuses K tapped target layers into a context (fc, then hidden_norm, once) and runs a
few Qwen3-style decoder layers over blocks of B tokens. In each layer the queries come only from
the block tokens; the keys and values are the layer's k_proj/v_proj of the context (k_norm, RoPE
at the context positions) followed by the block tokens' own. The context never passes through
q_proj, o_proj or the MLP. The token embedding and LM head belong to the target: they are
frozen, passed in by the caller, and never part of the model, so its state_dict() is the
serving checkpoint (z-lab / vLLM / SGLang format) as is.

Block slot 0 holds the anchor (the last committed token), slots 1..B-1 the mask token; slot k is
trained to predict the token at anchor + k (`drafters/blocks.py`), so a block drafts B - 1 tokens.

`config.py` is the drafter's geometry and its serving config.json, `model.py` the draft model,
`family.py` the objective, the FLOPs count, the export and the draft head (its `FAMILY`), and
`settings.py` its settings (the backbone's only). `modeling_dflash.py` is the remote-code file
every export carries; the package never imports it. Light: importing the package loads no torch.
"""
