"""Build ``data/tiny-target/``: a tiny Qwen3 target model, trained on the bundled chat data, for demos and tests.

Nothing can be downloaded from a model hub, so everything is made here, deterministically:

- a byte-level BPE tokenizer trained with the ``tokenizers`` library on the bundled chat data
  (``data/chat.jsonl``, written by ``make_dataset.py``; it is regenerated first if missing), with
  Qwen-style special tokens appended after the learned vocabulary:
  ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and ``<|mask|>`` (the mask
  token a DFlash drafter puts in its block slots 1..B-1);
- a Qwen3-style ChatML chat template with ``{% generation %}`` markers around each assistant
  reply and its ``<|im_end|>``, so ``return_assistant_tokens_mask=True`` works;
- a ``Qwen3ForCausalLM`` with 8 layers, hidden size 64, 4 heads / 2 KV heads of size 16,
  initialised from a fixed seed, then trained as a causal LM and saved in bfloat16 as safetensors.

A randomly initialised target is no teacher (near-uniform logits, hidden states that carry no
next-token information), so the model is trained on CPU, in float32, with AdamW (lr 3e-3, 5%
linear warmup, cosine decay to 5%, weight decay 0.01, gradients clipped to norm 1) for a fixed
STEPS = 1500 steps. Batches are whole conversations rendered exactly as ``dflash extract`` renders
them (``apply_chat_template(messages, tokenize=True)``), sorted by length into batches of about
2048 tokens, visited in a seeded order; the loss is next-token cross-entropy on every real token.
The data are ``chat.jsonl`` (400 conversations) plus EXTRA = 6000 more conversations from
``make_dataset``'s own generators (seed 4242), skipping any that opens with a ``prompts.jsonl``
user turn so those prompts stay held out. On ``chat.jsonl`` alone (42k tokens) the model only
memorises (training loss 0.06 nats/token, but 1.19 on fresh conversations, and answers ignore the
prompt); with the extra conversations (657k tokens, about 4.5 epochs) it generalises.

Result (torch 2.13 CPU, transformers 5.24, 1 thread, about 200 s of training): loss over
``chat.jsonl`` in bfloat16 0.292 nats/token (last-epoch training loss 0.307); on 200 fresh
conversations from the prompt seed 0.337 (0.298 on assistant tokens). Greedy answers to
held-out prompts are in the corpus style, with the prompt's numbers and names mostly carried over
but arithmetic often wrong, e.g. "What is 10 x 24?" -> "Split 24 into 20 and 4. 10 x 20 = 100. ...".

Training runs on one thread by default (``--threads``): the result then depends on no core count,
and on a CPU shared with other jobs two threads were many times slower (threads waiting on each
other), while one thread takes about 0.14 s a step. Rerunning the script rewrites byte-identical
files on the same machine with the same library versions and thread count.

Usage: ``python data/make_tiny_target.py [--out data/tiny-target] [--steps N] [--extra N] [--threads N]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterable, Iterator
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

# Training: whole conversations, about BATCH_TOKENS padded tokens a batch, STEPS AdamW steps.
STEPS = 1500
BATCH_TOKENS = 2048
LR = 3e-3
MIN_LR_FRAC = 0.05
WARMUP_FRAC = 0.05
WEIGHT_DECAY = 0.01
EXTRA = 6000
EXTRA_SEED = 4242
THREADS = 1  # see the docstring: one thread is both reproducible everywhere and fastest on a shared CPU


def corpus(chat_path: Path) -> Iterator[str]:
    """Every message of the bundled chat data, role names included (they appear in prompts)."""
    with open(chat_path, encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["role"] + "\n" + m["content"]


def build_tokenizer(chat_path: Path):
    return byte_bpe_tokenizer(corpus(chat_path), BPE_VOCAB, SPECIAL_TOKENS, mask_token="<|mask|>",
                              max_length=GEOMETRY["max_position_embeddings"])  # fmt: skip


def byte_bpe_tokenizer(texts: Iterable[str], bpe_vocab: int, special_tokens: list[str], *, mask_token: str | None,
                       max_length: int):  # fmt: skip
    """A byte-level BPE tokenizer learned from `texts`, Qwen's pre-tokenizer and ChatML template;
    the special tokens come after the learned vocabulary. Also make_code_target's."""
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
        vocab_size=bpe_vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Appended after the learned vocabulary, as in Qwen; special, so never split or merged.
    tok.add_special_tokens(special_tokens)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        **({"mask_token": mask_token} if mask_token else {}),
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer):
    """The untrained model, float32, initialised from SEED."""
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
    return Qwen3ForCausalLM(config).float()


def read_conversations(path: Path) -> list[list[dict]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def extra_conversations(n: int, prompts_path: Path) -> list[list[dict]]:
    """``n`` more conversations from ``make_dataset``'s generators (seed EXTRA_SEED), none of them
    opening with a held-out prompt's user turn, so ``prompts.jsonl`` stays held out."""
    sys.path.insert(0, str(HERE))
    import make_dataset

    held_out = {m["content"] for c in read_conversations(prompts_path) for m in c if m["role"] == "user"}
    rng = make_dataset.random.Random(EXTRA_SEED)
    out: list[list[dict]] = []
    while len(out) < n:
        c = make_dataset.conversation(rng)
        if next(m["content"] for m in c if m["role"] == "user") not in held_out:
            out.append(c)
    return out


def encode_conversations(convs: list[list[dict]], tokenizer) -> list[list[int]]:
    """Each conversation rendered as ``dflash extract`` renders it (the whole chat, no generation prompt)."""
    # transformers 5: tokenize=True returns a BatchEncoding, not a bare list of ids.
    return [list(tokenizer.apply_chat_template(c, tokenize=True)["input_ids"]) for c in convs]


def make_batches(convs: list[list[int]], pad_id: int, batch_tokens: int = BATCH_TOKENS):
    """Whole conversations, sorted by length and cut into batches of about `batch_tokens` padded tokens
    (make_code_target.py batches the same way).

    Each batch is (input_ids, attention_mask, labels); labels are -100 on padding, so the loss is
    next-token cross-entropy on every real token. Returned in a fixed order.
    """
    import torch

    order = sorted(range(len(convs)), key=lambda i: (len(convs[i]), i))
    groups, cur = [], []
    for i in order:  # lengths ascend, so the longest row of a group is its last
        if cur and (len(cur) + 1) * len(convs[i]) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    batches = []
    for g in groups:
        width = max(len(convs[i]) for i in g)
        ids = torch.full((len(g), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(g), width), dtype=torch.long)
        for r, i in enumerate(g):
            ids[r, : len(convs[i])] = torch.tensor(convs[i])
            att[r, : len(convs[i])] = 1
        batches.append((ids, att, ids.masked_fill(att == 0, -100)))
    return batches


def train(model, batches, steps: int, *, lr: float = LR, device=None, time_budget: float | None = None,
          log_every: int = 50) -> tuple[float, int]:
    """AdamW with linear warmup and cosine decay to MIN_LR_FRAC of `lr`, a seeded fixed batch order,
    bf16 autocast on a GPU; returns the token-weighted mean loss over the last epoch's worth of
    steps and the steps taken. With a time budget (seconds), the step time of steps 5-25 decides
    how many of the `steps` fit, and the cosine ends there (the warmup stays a fraction of `steps`).
    Also make_code_target's loop."""
    import math
    import time

    import torch

    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY, fused=cuda)
    warmup = max(1, int(WARMUP_FRAC * steps))
    total = steps

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return lr * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    queue: list[int] = []
    recent: list[tuple[float, int]] = []  # (summed loss, tokens) of the last len(batches) steps
    start = time.perf_counter()
    step = 0
    while step < total:
        if time_budget is not None and step in (5, 25):
            if cuda:
                torch.cuda.synchronize()
            if step == 5:
                probe = time.perf_counter()
            else:
                per_step = (time.perf_counter() - probe) / 20
                total = max(26, min(steps, 25 + int((time_budget - (time.perf_counter() - start)) / per_step)))
                print(f"time budget {time_budget:.0f}s at {per_step:.3f}s a step: {total} steps", flush=True)
        if not queue:  # a fresh seeded permutation of the batches each epoch
            queue = torch.randperm(len(batches), generator=gen).tolist()
        ids, att, labels = (t.to(device, non_blocking=True) for t in batches[queue.pop()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # Mean over the batch's predicted tokens (the model shifts labels itself).
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        n = int((labels[:, 1:] != -100).sum())
        recent = [*recent[-(len(batches) - 1) :], (loss.item() * n, n)]
        if step % log_every == 0 or step == total - 1:
            avg = sum(x for x, _ in recent) / sum(n for _, n in recent)
            print(f"step {step:5d}/{total}  lr {lr_at(step):.2e}  loss {loss.item():.4f}  recent {avg:.4f}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)  # fmt: skip
        step += 1
    model.eval()
    return sum(x for x, _ in recent) / sum(n for _, n in recent), total


def corpus_loss(model, batches, device=None) -> float:
    """Token-weighted next-token loss of ``model`` (as it is, e.g. bf16) over `batches`."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            ids, att, labels = (t.to(device) if device is not None else t for t in b)
            n = int((labels[:, 1:] != -100).sum())
            total += model(input_ids=ids, attention_mask=att, labels=labels).loss.float().item() * n
            count += n
    return total / count


def sample(model, tokenizer, prompts_path: Path, max_new_tokens: int = 60) -> str:
    """Greedy continuation of the first held-out prompt, rendered with the generation prompt."""
    import torch

    with open(prompts_path, encoding="utf-8") as f:
        messages = json.loads(f.readline())["messages"]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = tokenizer.decode(enc["input_ids"][0], skip_special_tokens=False)
    return prompt + tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "tiny-target")
    ap.add_argument("--chat", type=Path, default=HERE / "chat.jsonl")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts.jsonl")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps (default %(default)s)")
    ap.add_argument("--extra", type=int, default=EXTRA, help="generated conversations (default %(default)s)")
    ap.add_argument("--threads", type=int, default=THREADS, help="torch CPU threads (default %(default)s)")
    args = ap.parse_args()

    if not args.chat.exists():
        sys.path.insert(0, str(HERE))
        import make_dataset

        make_dataset.write_jsonl(args.chat, make_dataset.make_conversations(make_dataset.TRAIN_SEED, 400))

    import time

    import torch

    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer(args.chat)
    model = build_model(tokenizer)
    chat = encode_conversations(read_conversations(args.chat), tokenizer)
    extra = encode_conversations(extra_conversations(args.extra, args.prompts), tokenizer)
    batches = make_batches(chat + extra, tokenizer.pad_token_id)
    tokens = sum(int(att.sum()) for _, att, _ in batches)
    print(f"training: {len(batches)} batches, {tokens} tokens, {args.steps} steps, {args.threads} threads", flush=True)
    start = time.perf_counter()
    last_epoch, _ = train(model, batches, args.steps)
    took = time.perf_counter() - start
    model = model.to(torch.bfloat16)
    final = corpus_loss(model, make_batches(chat, tokenizer.pad_token_id))
    print(f"trained in {took:.0f}s: last-epoch training loss {last_epoch:.4f}; chat.jsonl loss in bf16 {final:.4f}")

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
    print("greedy sample:\n" + sample(model, tokenizer, args.prompts))


if __name__ == "__main__":
    main()
