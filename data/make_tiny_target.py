"""Build ``data/tiny-target/``: a tiny, random-initialised Qwen3 target model for demos and tests.

Nothing can be downloaded from a model hub, so everything is made here, deterministically:

- a byte-level BPE tokenizer trained with the ``tokenizers`` library on the bundled chat data
  (``data/chat.jsonl``, written by ``make_dataset.py``; it is regenerated first if missing), with
  Qwen-style special tokens appended after the learned vocabulary:
  ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and ``<|mask|>`` (the mask
  token a DFlash drafter puts in its block slots 1..B-1);
- a Qwen3-style ChatML chat template with ``{% generation %}`` markers around each assistant
  reply and its ``<|im_end|>``, so ``return_assistant_tokens_mask=True`` works;
- a ``Qwen3ForCausalLM`` with 8 layers, hidden size 64, 4 heads / 2 KV heads of size 16,
  initialised from a fixed seed and saved in bfloat16 as safetensors.

Rerunning the script rewrites byte-identical files (with the same library versions).

Usage: ``python data/make_tiny_target.py [--out data/tiny-target]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
BPE_VOCAB = 1532  # learned tokens (bytes + merges); 4 special tokens bring it to 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# Qwen2/Qwen3 pre-tokenizer pattern: digits are split one by one, which keeps arithmetic learnable.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as in Qwen3, without the tool-calling and thinking parts. The generation markers wrap
# exactly what the model must learn to produce for an assistant turn: the reply and <|im_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message['role'] in ['system', 'user'] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GEOMETRY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def corpus(chat_path: Path) -> Iterator[str]:
    """Every message of the bundled chat data, role names included (they appear in prompts)."""
    with open(chat_path, encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["role"] + "\n" + m["content"]


def build_tokenizer(chat_path: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(chat_path), trainer=trainer)
    # Appended after the learned vocabulary, as in Qwen; special, so never split or merged.
    tok.add_special_tokens(SPECIAL_TOKENS)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=GEOMETRY["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tokenizer) // 64) * 64
    config = Qwen3Config(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        **GEOMETRY,
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "tiny-target")
    ap.add_argument("--chat", type=Path, default=HERE / "chat.jsonl")
    args = ap.parse_args()

    if not args.chat.exists():
        sys.path.insert(0, str(HERE))
        import make_dataset

        make_dataset.write_jsonl(args.chat, make_dataset.make_conversations(make_dataset.TRAIN_SEED, 400))

    tokenizer = build_tokenizer(args.chat)
    model = build_model(tokenizer)

    # Write next to the destination, then swap, so a failed run never leaves half a model.
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)

    n_params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in args.out.iterdir())
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    print(
        f"wrote {args.out}: {n_params} parameters, vocab {len(tokenizer)} "
        f"(model {model.config.vocab_size}), {size / 1024:.0f} KiB; special ids {ids}"
    )


if __name__ == "__main__":
    main()
