"""Tiny local targets laid out like real model families (Qwen3, Llama 3, Gemma, Qwen3.5), for tests and GPU runs.

The bundled ``data/tiny-target`` has a reserved ``<|mask|>`` and a chat template with generation
markers, which no real family ships. These targets have what real ones have, and nothing more:

- a byte-level BPE tokenizer trained in well under a second on ``data/chat.jsonl``, with the
  family's special tokens where the family puts them, and **no mask token**:

  - qwen3: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), then ``<think>`` and
    ``</think>`` as plain (non-special) added tokens, all after the learned vocabulary; the
    model's ``vocab_size`` is larger than ``len(tokenizer)`` (Qwen3-8B: 151,936 vs 151,669);
  - llama3: ``<|begin_of_text|>`` (bos, added to plain text by the tokenizer),
    ``<|end_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>`` (eos) and
    reserved special tokens that fill the vocabulary, so ``vocab_size == len(tokenizer)`` as in
    Llama 3 (128,256): no spare embedding row for a mask id;
  - gemma: ``<pad>``, ``<eos>``, ``<bos>`` (added to plain text), ``<unk>`` first in the
    vocabulary, ``<start_of_turn>`` and ``<end_of_turn>`` after it; ``vocab_size`` larger than
    ``len(tokenizer)`` as in Gemma 3;
  - qwen3_5 and qwen3_5_vl: Qwen3's tokens plus the vision markers Qwen3.5 puts after
    ``<|im_end|>`` (``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
    ``<|video_pad|>``), Qwen3.5's pre-tokenizer (letters with their combining marks), a padded
    table (Qwen3.5: 248,320 rows);

- the family's chat template, written here to behave like the official one: Qwen3's drops the
  ``<think>`` block of every assistant turn before the last user message and honours
  ``enable_thinking``; Llama 3.1's opens with a system block carrying the knowledge-cutoff lines;
  Gemma's folds a system message into the first user turn and calls the assistant ``model``.
  Qwen3.5's renders turns as Qwen3's does, but its generation prompt opens the think block
  (``<|im_start|>assistant\n<think>\n``) unless ``enable_thinking`` is false.
  None has ``{% generation %}`` markers;
- a randomly initialised model of the family's architecture (Qwen3ForCausalLM, LlamaForCausalLM,
  Gemma2ForCausalLM), 4 layers of width 64 by default, saved as safetensors, with a
  ``generation_config.json`` listing the family's end-of-turn ids;
- the hybrids (Qwen3.5, Qwen3.6): gated delta-net (linear attention) layers beside full-attention
  ones, three linear layers to one full one as the real models have them, 8 layers by default.
  ``qwen3_5`` is a text-only ``Qwen3_5ForCausalLM`` (``model.layers.*``); ``qwen3_5_vl`` is laid
  out as the published hub checkpoints are: a ``Qwen3_5ForConditionalGeneration`` whose config
  nests ``text_config`` and ``vision_config`` (a tiny vision tower), weights under
  ``model.language_model.*``, ``model.visual.*`` and ``lm_head``, plus the multi-token-prediction
  head's ``mtp.*`` weights that transformers ignores on load. Both have the real models'
  partial rotary (a quarter of each head), multimodal RoPE sections and gated attention output.
- the mixture-of-experts layouts that `extract --tp` shards (``MOE``), with the tokens and template of
  a family above (``TOKENS``): ``qwen3_moe`` (every layer's MLP routed over experts), ``qwen3_5_moe``
  and ``qwen3_5_moe_vl`` (Qwen3.5's hybrid layers with routed and shared experts, text-only and in
  the multimodal hub layout), ``deepseek_v3`` (multi-head latent attention, a dense first layer, then
  shared and grouped-routed experts) and ``gpt_oss`` (sliding-window and full attention layers in
  turn, attention sinks, biased experts); see ``moe_fields``.

Usage: ``python tests/family_targets.py --family qwen3 --out DIR`` (families: FAMILIES and MOE below)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
if str(DATA) not in sys.path:  # make_tiny_target is a script of data/, not a package module
    sys.path.insert(0, str(DATA))

from make_tiny_target import PRETOKENIZE_REGEX, corpus  # noqa: E402

FAMILIES = ("qwen3", "llama3", "gemma", "qwen3_5", "qwen3_5_vl")
HYBRIDS = ("qwen3_5", "qwen3_5_vl")  # linear-attention (gated delta-net) layers beside full-attention ones
# Mixture-of-experts layouts (the big targets that extract shards with --tp): each borrows the tokens and
# template of the family named in TOKENS, which these tests exercise already.
MOE = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl", "deepseek_v3", "gpt_oss")
TOKENS = {"qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_vl": "qwen3_5", "deepseek_v3": "qwen3",
          "gpt_oss": "qwen3"}  # fmt: skip
THINKING = ("qwen3", *HYBRIDS)  # the families with Qwen's <think> syntax
BPE_MERGES = 400  # enough for common words to be one or two tokens, and trains in a fraction of a second
MAX_POSITIONS = 4096

# Qwen3's template, rewritten: ChatML; an assistant turn's reasoning comes from `reasoning_content`
# or from the text before `</think>` in its content; the think block is rendered only for assistant
# turns after the last user message (the last turn always gets one, empty if need be).
QWEN3_TURNS = """\
{%- if messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set state = namespace(last_user=messages|length - 1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{%- set state.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set text = m.content if m.content is string else '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set thought = '' %}
{%- if m.reasoning_content is string %}
{%- set thought = m.reasoning_content %}
{%- elif '</think>' in text %}
{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set text = text.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > state.last_user and (loop.last or thought) %}
{{- '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + text }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif m.role != 'system' %}
{{- raise_exception('unknown role: ' + m.role) }}
{%- endif %}
{%- endfor %}
"""
QWEN3_TEMPLATE = (
    QWEN3_TURNS
    + """\
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
)
# Qwen3.5's: the same turns, but its generation prompt opens the think block when thinking is on.
QWEN3_5_TEMPLATE = (
    QWEN3_TURNS
    + """\
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
)

# Llama 3.1's layout: a system block always opens the chat (cutoff and date lines, then the
# system message if any); every message's content is trimmed.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if messages and messages[0].role == 'system' %}
{%- set system_text = messages[0].content | trim %}{%- set turns = messages[1:] %}
{%- else %}
{%- set system_text = '' %}{%- set turns = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' + system_text + '<|eot_id|>' }}
{%- for m in turns %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Gemma's layout (as Gemma 3 handles a system message): user and model turns must alternate.
GEMMA_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set prefix = messages[0].content | trim + '\\n\\n' %}{%- set turns = messages[1:] %}
{%- else %}
{%- set prefix = '' %}{%- set turns = messages %}
{%- endif %}
{%- for m in turns %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if m.role in ['assistant', 'model'] else m.role %}
{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + m.content | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class Family:
    """Where a family puts its tokens, what its template is, and which model class it uses."""

    architecture: str  # the transformers config class's model_type
    leading: tuple[str, ...]  # special tokens before the learned vocabulary (ids 0..)
    trailing: tuple[str, ...]  # special tokens after it
    plain: tuple[str, ...]  # added tokens that are not special (kept by skip_special_tokens)
    roles: dict[str, str]  # tokenizer attribute -> token: bos_token, eos_token, pad_token, unk_token
    listed: tuple[str, ...]  # the tokenizer config's additional special tokens, as the family's lists them
    stop: tuple[str, ...]  # the end-of-turn tokens generation stops at
    template: str
    add_bos: bool  # whether the tokenizer prepends bos to plain text, as the real one does
    regex: str
    reserved: str | None = None  # fill len(tokenizer) to a multiple of 64 with these, then vocab == len
    model: tuple[tuple[str, object], ...] = ()  # extra config fields
    nfc: bool = False  # whether the tokenizer normalizes text to NFC first (Qwen3.5's does)
    layers: int = 4  # decoder layers by default
    auto_class: str = "AutoModelForCausalLM"  # the transformers Auto class that builds the checkpoint


# Llama 3 groups digits by up to three; Qwen splits them one by one. Qwen3.5 keeps a letter's
# combining marks (\p{M}) in its word.
LLAMA3_REGEX = PRETOKENIZE_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
QWEN3_5_REGEX = PRETOKENIZE_REGEX.replace(r"\p{L}+", r"[\p{L}\p{M}]+").replace(
    r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]"
)
QWEN3_5_VISION = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

SPECS: dict[str, Family] = {
    "qwen3": Family(
        architecture="qwen3",
        leading=(),
        trailing=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        plain=("<think>", "</think>"),
        roles={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        listed=("<|im_start|>", "<|im_end|>"),
        stop=("<|im_end|>", "<|endoftext|>"),
        template=QWEN3_TEMPLATE,
        add_bos=False,
        regex=PRETOKENIZE_REGEX,
        model=(("rope_theta", 1_000_000.0), ("tie_word_embeddings", False)),
    ),
    "llama3": Family(
        architecture="llama",
        leading=(),
        # Llama 3.1's first eleven specials in their order; reserved ones fill the rest.
        trailing=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        plain=(),
        roles={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        listed=(),
        stop=("<|eot_id|>", "<|end_of_text|>"),
        template=LLAMA3_TEMPLATE,
        add_bos=True,
        regex=LLAMA3_REGEX,
        reserved="<|reserved_special_token_{}|>",
        model=(("rope_theta", 500_000.0), ("tie_word_embeddings", False)),
    ),
    "gemma": Family(
        architecture="gemma2",
        leading=("<pad>", "<eos>", "<bos>", "<unk>"),
        trailing=("<start_of_turn>", "<end_of_turn>"),
        plain=(),
        roles={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        listed=("<start_of_turn>", "<end_of_turn>"),
        stop=("<end_of_turn>", "<eos>"),
        template=GEMMA_TEMPLATE,
        add_bos=True,
        regex=PRETOKENIZE_REGEX,
        model=(("tie_word_embeddings", True), ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0)),
    ),
}
# The Qwen3.5 checkpoints share one tokenizer and template; the text model's config is the same in
# both layouts (the multimodal one nests it as text_config).
_QWEN3_5 = dict(
    leading=(),
    trailing=("<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN3_5_VISION),
    plain=("<think>", "</think>"),
    roles={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    listed=("<|im_start|>", "<|im_end|>", *QWEN3_5_VISION),
    stop=("<|im_end|>", "<|endoftext|>"),
    template=QWEN3_5_TEMPLATE,
    add_bos=False,
    regex=QWEN3_5_REGEX,
    nfc=True,
    model=(("tie_word_embeddings", False),),  # as Qwen3.5-9B and -27B (the small ones tie)
    layers=8,
)
SPECS["qwen3_5"] = Family(architecture="qwen3_5_text", **_QWEN3_5)
SPECS["qwen3_5_vl"] = Family(architecture="qwen3_5", auto_class="AutoModelForImageTextToText", **_QWEN3_5)
SPECS["qwen3_moe"] = replace(SPECS["qwen3"], architecture="qwen3_moe")
SPECS["qwen3_5_moe"] = replace(SPECS["qwen3_5"], architecture="qwen3_5_moe_text")
SPECS["qwen3_5_moe_vl"] = replace(SPECS["qwen3_5_vl"], architecture="qwen3_5_moe")
SPECS["deepseek_v3"] = replace(SPECS["qwen3"], architecture="deepseek_v3")
SPECS["gpt_oss"] = replace(SPECS["qwen3"], architecture="gpt_oss", model=(("tie_word_embeddings", False),))
MULTIMODAL = ("qwen3_5_vl", "qwen3_5_moe_vl")  # the hub checkpoints' layout: text_config, vision tower, mtp head


def _spec(family: str) -> Family:
    if family not in SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES + MOE)}")
    return SPECS[family]


def build_tokenizer(family: str, chat_path: Path = DATA / "chat.jsonl"):
    """The family's tokenizer (a `PreTrainedTokenizerFast`, chat template included), trained on `chat_path`."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    spec = _spec(family)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(spec.leading) + len(alphabet) + BPE_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
        special_tokens=list(spec.leading),  # the trainer puts these first, at ids 0..
    )
    tok.train_from_iterator(corpus(chat_path), trainer=trainer)
    tok.add_special_tokens(list(spec.trailing))
    if spec.reserved:
        used = sum(t.startswith(spec.reserved.split("{")[0]) for t in spec.trailing)
        spare = -tok.get_vocab_size(with_added_tokens=True) % 64
        tok.add_special_tokens([spec.reserved.format(used + k) for k in range(spare)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    if spec.add_bos:
        bos = spec.roles["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=spec.template,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=list(spec.listed),  # transformers 5 reads it as extra_special_tokens
        **spec.roles,
    )


def family_vocab_size(family: str, tokenizer_len: int) -> int:
    """The embedding rows of the family's model: `len(tokenizer)` when the family's tokenizer fills its
    table (Llama 3), otherwise the next multiple of 64 at least 64 rows past it (Qwen3's padding)."""
    return tokenizer_len if _spec(family).reserved else -(-(tokenizer_len + 64) // 64) * 64


def hybrid_fields(hidden: int, heads: int, layers: int) -> dict:
    """The Qwen3.5 text config's own fields at a tiny size, in the real models' proportions
    (Qwen3.5-9B: 16 heads of 256, linear attention 16 key and 32 value heads of 128, a quarter of
    each head rotated, RoPE sections 11/11/10 of its 32 frequencies)."""
    head_dim = hidden // heads
    frequencies = max(1, head_dim // 8)  # a quarter of the head rotated: head_dim / 8 frequencies
    t = h = round(frequencies * 11 / 32)
    sections = [t, h, frequencies - t - h]  # temporal, height, width
    return {
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_num_value_heads": heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": sections, "mrope_interleaved": True},
        "mtp_num_hidden_layers": 1,  # the checkpoint's mtp.* head, which transformers ignores
        "mtp_use_dedicated_embeddings": False,
    }  # fmt: skip


def moe_fields(architecture: str, hidden: int, heads: int, layers: int) -> dict:
    """A MoE family's own config fields at a tiny size, in the real models' layout: 4 routed experts,
    2 per token; Qwen3.5-MoE adds a shared expert; DeepSeek-V3 has multi-head latent attention
    (low-rank queries and keys-values, a rotary part beside each head), a shared expert and dense
    first layers (as its first 3 of 61), grouped routing; GPT-OSS alternates sliding-window and full
    attention layers, with learned attention sinks and biased experts."""
    head_dim = hidden // heads
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden}
    if architecture == "qwen3_moe":
        return {**experts, "norm_topk_prob": True}
    if architecture.startswith("qwen3_5_moe"):
        return {**experts, "shared_expert_intermediate_size": hidden}
    if architecture == "deepseek_v3":
        return {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
                "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "num_key_value_heads": heads,
                "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 2, "qk_rope_head_dim": head_dim,
                "qk_nope_head_dim": head_dim, "v_head_dim": head_dim}  # fmt: skip
    if architecture == "gpt_oss":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32, "layer_types": kinds}
    return {}


# A tiny vision tower of the multimodal layout, whose output width is the text model's.
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}  # fmt: skip


def build_config(family: str, tokenizer, *, hidden: int = 64, layers: int | None = None, vocab_size: int | None = None):
    """A tiny config of the family's architecture for `tokenizer` (heads of about 16 dims, half as many KV heads)."""
    from transformers import AutoConfig

    spec = _spec(family)
    layers = layers or spec.layers
    heads = max(1, hidden // 16)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of {heads} heads")
    head_dim = hidden // heads
    ids = {role: tokenizer.convert_tokens_to_ids(tok) for role, tok in spec.roles.items()}
    extra = dict(spec.model)
    if spec.architecture == "gemma2":
        extra["query_pre_attn_scalar"] = head_dim
    if spec.architecture.startswith("qwen3_5"):
        extra.update(hybrid_fields(hidden, heads, layers))
    extra.update(moe_fields(spec.architecture, hidden, heads, layers))
    text = dict(
        vocab_size=vocab_size or family_vocab_size(family, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        bos_token_id=ids.get("bos_token"),
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in spec.stop],
        pad_token_id=ids.get("pad_token"),
    )
    text.update(extra)
    if family not in MULTIMODAL:
        return AutoConfig.for_model(spec.architecture, **text)
    token = tokenizer.convert_tokens_to_ids
    return AutoConfig.for_model(
        spec.architecture,
        text_config={"model_type": f"{spec.architecture}_text", **text},
        vision_config={**VISION, "out_hidden_size": hidden},
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def generation_config(family: str, tokenizer):
    """Generation stops at any of the family's end-of-turn tokens, as the published configs say."""
    from transformers import GenerationConfig

    spec = _spec(family)
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in spec.stop],
        pad_token_id=tokenizer.pad_token_id,
    )


def build(family: str, out: Path, *, hidden: int = 64, layers: int | None = None, seed: int = 0,
          vocab_size: int | None = None) -> Path:  # fmt: skip
    """Write a loadable target directory of `family` to `out` and return `out`.

    `layers` defaults to the family's (4; 8 for the hybrids). `vocab_size` overrides the family's
    embedding rows (e.g. to give a Llama-3-style target room for a mask id past `len(tokenizer)`).
    """
    import torch
    import transformers

    out = Path(out)
    tokenizer = build_tokenizer(family)
    config = build_config(family, tokenizer, hidden=hidden, layers=layers, vocab_size=vocab_size)
    vocab = config.get_text_config().vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is below the tokenizer's {len(tokenizer)} tokens")
    torch.manual_seed(seed)
    model = getattr(transformers, _spec(family).auto_class).from_config(config, dtype=torch.float32)
    model.generation_config = generation_config(family, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if family in MULTIMODAL:
        _add_mtp_weights(out / "model.safetensors", config.get_text_config(), seed)
    tokenizer.save_pretrained(out)
    return out


def _add_mtp_weights(path: Path, text_config, seed: int) -> None:
    """Add the multi-token-prediction head that the published Qwen3.5 checkpoints carry (``mtp.*``:
    one full-attention layer with its fusion ``fc`` and norms), which transformers skips on load."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    torch.manual_seed(seed + 1)
    full = text_config.layer_types.index("full_attention")
    h = text_config.hidden_size
    moe = text_config.model_type == "qwen3_5_moe_text"
    layer = modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer if moe else modeling_qwen3_5.Qwen3_5DecoderLayer
    mtp = {f"layers.0.{k}": v for k, v in layer(text_config, full).state_dict().items()}
    mtp["fc.weight"] = torch.randn(h, 2 * h) * 0.02
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"{norm}.weight"] = torch.zeros(h)  # Qwen3.5's norms scale by 1 + weight
    weights = load_file(path)
    weights.update({f"mtp.{k}": v.contiguous() for k, v in mtp.items()})
    save_file(weights, path, metadata={"format": "pt"})


# A small fixed vocabulary of sentences in the style of the bundled chat data, so it tokenizes well.
QUESTIONS = (
    "Tell me a short story about Bram.",
    "Who is the lamplighter of Harrow Pier?",
    "What is 12 + 30?",
    "Now double it.",
    "Reverse the letters of the word button.",
    "Where does Oona the baker live?",
)
ANSWERS = (
    "Bram the ferryman could not find his kettle anywhere. He asked the neighbours, but nobody had seen it.",
    "Ila the lamplighter lives in Harrow Pier.",
    "12 + 30 = 42.",
    "Double 42 is 42 x 2 = 84.",
    "'button' backwards is 'nottub'. Letter by letter: n-o-t-t-u-b.",
    "Oona the baker lives in Mossfield, next to the old mill.",
)
THOUGHTS = (
    "The user asks for a sum. 12 + 30: add the tens, 10 + 30 = 40, then the ones, 40 + 2 = 42.",
    "Double means times two. 42 x 2 = 84.",
    "Oona is the baker. The baker lives in Mossfield.",
)
SYSTEMS = ("You are the storyteller of the island of Wend.", "End every answer with the words: Safe travels!")


def _chat(*turns: str | dict, system: str | None = None) -> dict:
    """An OpenAI `messages` row from alternating user and assistant turns (a dict is a whole message)."""
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        messages.append(turn if isinstance(turn, dict) else {"role": ("user", "assistant")[i % 2], "content": turn})
    return {"messages": messages}


def _inline(thought: str, answer: str) -> str:
    """A reply with its reasoning inline, as Qwen3 writes it."""
    return f"<think>\n{thought}\n</think>\n\n{answer}"


def _reasoned(thought: str, answer: str) -> dict:
    """An assistant message with its reasoning in a separate field, as reasoning parsers return it."""
    return {"role": "assistant", "content": answer, "reasoning_content": thought}


def example_rows(family: str) -> list[dict]:
    """About a dozen rows a user of `family` might have: single- and multi-turn, with a system turn,
    with reasoning, one assistant reply with surrounding whitespace, and one prompt/response row.

    For the Qwen families the reasoning is given both ways the template reads it (a `reasoning_content` field,
    and ``<think>...</think>`` inline in the content), in the last turn and in earlier ones. The
    other families have no reasoning syntax, so there the reasoning is just text in the reply.
    """
    _spec(family)
    q, a, t, s = QUESTIONS, ANSWERS, THOUGHTS, SYSTEMS
    rows = [
        _chat(q[0], a[0]),
        _chat(q[1], a[1], system=s[0]),
        _chat(q[2], a[2], q[3], a[3]),
        _chat(q[4], a[4], q[5], a[5], q[2], a[2], system=s[1]),
        _chat(q[5], "  " + a[5] + "\n"),
        {"prompt": q[1], "response": a[1]},
    ]
    if TOKENS.get(family, family) in THINKING:
        return rows + [
            _chat(q[2], _reasoned(t[0], a[2])),
            _chat(q[2], _inline(t[0], a[2])),
            _chat(q[2], _inline(t[0], a[2]), q[3], _inline(t[1], a[3])),
            _chat(q[2], _reasoned(t[0], a[2]), q[3], _reasoned(t[1], a[3]), system=s[0]),
            _chat(q[5], _inline(t[2], a[5]), q[0], a[0]),
            _chat(q[4], a[4], q[2], _inline(t[0], a[2])),
        ]
    return rows + [
        _chat(q[2], f"Let me think. {t[0]} So the answer is: {a[2]}"),
        _chat(q[2], _inline(t[0], a[2])),
        _chat(q[2], f"{t[0]} {a[2]}", q[3], f"{t[1]} {a[3]}", system=s[1]),
        _chat(q[5], f"{t[2]} {a[5]}", q[0], a[0]),
        _chat(q[4], a[4], q[2], f"Let me think. {t[0]}\n\n{a[2]}"),
        _chat(q[3], a[3], system=s[0]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES + MOE, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the family's, 4; 8 for hybrids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=None, help="embedding rows (default: the family's)")
    ap.add_argument("--rows", type=Path, default=None, help="also write example_rows(family) to this JSONL file")
    args = ap.parse_args()
    out = build(args.family, args.out, hidden=args.hidden, layers=args.layers, seed=args.seed,
                vocab_size=args.vocab_size)  # fmt: skip
    if args.rows:
        args.rows.write_text("".join(json.dumps(r) + "\n" for r in example_rows(args.family)))
    config = json.loads((out / "config.json").read_text())
    print(f"wrote {args.family} target {out} (vocab_size {config.get('text_config', config)['vocab_size']})")


if __name__ == "__main__":
    main()
