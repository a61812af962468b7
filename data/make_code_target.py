"""Build a code target: a small Qwen3 trained on the running interpreter's standard library, and its data.

The drafter-quality run (``benchmarks/quality.py``) and the demo need a target whose text is real, and
nothing can be downloaded here. Every machine has a real corpus nobody here wrote: the Python
standard library's own ``**/*.py`` files. This script makes, deterministically from a seed:

- a byte-level BPE tokenizer trained with ``tokenizers`` on the training modules, with three
  special tokens appended: ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos), and
  **no mask token**. The model's embedding table is larger than the tokenizer (rounded up to a
  multiple of 64 past it), as in Qwen3, so ``dflash extract`` takes the mask id from the rule
  ``len(tokenizer) < vocab_size`` (the id ``len(tokenizer)``);
- a ChatML chat template with ``{% generation %}`` markers around each assistant reply and its
  ``<|im_end|>``;
- the data, in the form prompts are asked: a **user turn holding a code prefix** (6 to 30 whole
  lines, at most 1200 characters) and an **assistant turn holding its continuation** (the lines
  after it up to the next blank line, 1 to 16 lines). Each module is walked front to back in
  windows of prefix + continuation, so every line is trained on once an epoch;
- a ``Qwen3ForCausalLM`` trained as a causal LM on those conversations rendered exactly as
  ``dflash extract`` renders them (loss on every token), saved in bfloat16 as safetensors.

Whole modules are held out (``HELD_OUT``: packages and single files that exist from Python 3.10
to 3.13), with their test files; ``corpus.json`` beside the model records them, the interpreter
version, the file counts and the token counts. Test suites (``test/``, ``tests/``,
``idle_test/``), ``site-packages``, and the generated tables of ``encodings/`` and ``pydoc_data/``
are not code anyone writes; the CPU size skips the test suites, the GPU sizes train on them too
(they need the data more than the CPU size does).

Three sizes (``--size``):

- ``cpu``: 8 layers, hidden 96, tied embeddings, 2048 embedding rows (2,003 tokens). A few
  minutes on 2 CPU cores; its output is committed as ``data/code-target`` with the data files
  ``data/code_train.jsonl`` (regen input: training-module prefixes with their original
  continuations) and ``data/code_prompts.jsonl`` (held-out-module prefixes, the eval prompts).
- ``gpu``: 12 layers, hidden 768 (96M parameters), 8,003 tokens in 8,064 rows, batches of 64K
  tokens in bf16 autocast on one GPU; ``--time-budget S`` fits the cosine schedule into S seconds.
- ``long``: the ``gpu`` geometry with 32,768 positions, a target to measure drafters' acceptance at
  8K-32K tokens of context on the ``long-code`` set (SmolLM2 has 8,192 positions). Beside the
  windows above it trains on **whole modules**: each module, cut into consecutive runs of whole
  lines of up to 32,768 tokens less LONG_SLACK, each run cut at a seeded line into the user turn
  ``long_code.continue_user(code)`` (the set's prompt, word for word) and the assistant turn that
  continues it; the first run of a module starts at its first line, as the set's prompts do. So it
  learns code at every position up to 32K and to continue a file after that prompt. Besides
  HELD_OUT it holds out every file on the eval side of long-code's module split
  (``code_prompts.held_out_module`` of its dotted name), where all of the set's modules are, and the
  test files named for those modules (``test_minidom.py``); ``corpus.json`` lists them under
  ``long_code_split`` and adds the whole-module counts and held-out loss under ``whole_modules``.
  A batch's padding is on the right and its attention mask all ones: no real token attends to the
  padding in a causal LM and the padding has no labels, so the loss is the masked batch's while
  attention takes its causal kernel (no mask of 32K by 32K a row). The longest sequence is the
  positions or ``--batch-tokens``, whichever is fewer, so ``--steps 2 --batch-tokens 1024`` (and a
  toy ``--geometry``) is a trial run on a CPU.

Training: AdamW (betas 0.9/0.95, weight decay 0.01), linear warmup 5%, cosine decay to 5% of the
peak, gradients clipped to norm 1, a seeded order of length-sorted batches. On CPU it runs in
float32 on one thread by default, with denormals flushed: on a CPU shared with other jobs two
threads stalled for minutes between steps (each waits for the other), and unflushed denormals
slow a step tenfold. Everything is seeded; the data files depend on the corpus and the seed only
(``--data-only`` rewrites them byte for byte without training). On a GPU the kernels are not
bitwise reproducible, so reruns agree only closely.

Result, CPU size (Python 3.11.7, torch 2.13 CPU, transformers 5.24): 1.01M parameters, 2.0 MB;
700 steps of 2048 tokens (0.48 epochs of 3.01M tokens): 829 s on the 2-core machine it was made
on, under a load average of 5-14 from other jobs (a 40-step trial at light load ran 0.25 s a
step); held-out loss 4.50 nats/token in bf16. Like any
small model's, its greedy continuations fall into loops (``self._c = self._c`` line after line),
which QUALITY.md weighs against a prompt-lookup drafter. GPU size on one H200: 0.31-0.46 s per 64K-token
step in a 55 s budget, held-out loss 4.50-4.76 over three builds (QUALITY.md).

Usage: ``python data/make_code_target.py --size cpu|gpu|long [--out DIR] [--data-dir DIR] [--steps N]
[--batch-tokens N] [--time-budget S] [--geometry JSON] [--stdlib DIR] [--data-only]``
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dflash_cache (size long)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_target import (  # noqa: E402 - the same tokenizer, batching and training loop
    byte_bpe_tokenizer,
    corpus_loss,
    make_batches,
    train,
)

HERE = Path(__file__).resolve().parent
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # no mask token, on purpose

# Held out for evaluation: whole modules (a package is its directory). All exist in 3.10-3.13.
HELD_OUT = ("argparse.py", "calendar.py", "configparser.py", "csv.py", "difflib.py", "fractions.py",
            "ftplib.py", "gettext.py", "heapq.py", "json", "shlex.py", "statistics.py", "textwrap.py")  # fmt: skip
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}

# Windows of the corpus: prefix lines, continuation lines, prefix characters.
PREFIX_LINES = (6, 30)
CONT_LINES = 16
PREFIX_CHARS = 1200
MAX_TOKENS = 1024  # longer conversations (a few, with very long lines) are not trained on
LONG_SLACK = 64  # of a whole-module piece's tokens: the chat template, the message's fence, tokens cut at its ends

@dataclass
class Size:
    bpe_vocab: int  # learned tokens; the specials come after
    geometry: dict
    steps: int
    batch_tokens: int  # padded tokens a batch
    lr: float
    with_tests: bool  # train on the test suites too
    threads: int = 1
    train_rows: int = 400  # regen input rows written beside the model
    prompt_rows: int = 64  # held-out prompts written beside the model
    extra: dict = field(default_factory=dict)
    positions: int = 2048  # max_position_embeddings
    whole_modules: bool = False  # also train on whole modules; hold out long-code's side of the module split


SIZES = {
    "cpu": Size(
        bpe_vocab=2000,
        geometry=dict(hidden_size=96, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),  # fmt: skip
        steps=700, batch_tokens=2048, lr=3e-3, with_tests=False, threads=1,
    ),
    "gpu": Size(
        bpe_vocab=8000,
        geometry=dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),  # fmt: skip
        steps=1500, batch_tokens=65536, lr=1.5e-3, with_tests=True, train_rows=3000, prompt_rows=64,
    ),
    "long": Size(
        bpe_vocab=8000,
        geometry=dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),  # fmt: skip
        steps=1500, batch_tokens=65536, lr=1.5e-3, with_tests=True, train_rows=3000, prompt_rows=64,
        positions=32768, whole_modules=True,
    ),
}
COMMON = dict(max_position_embeddings=2048, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_of(rel: Path) -> str:
    """The top-level module a stdlib file belongs to ('json' for json/decoder.py, 'csv.py')."""
    return rel.parts[0]


def is_test(rel: Path) -> bool:
    return any(p in TEST_DIRS for p in rel.parts[:-1]) or rel.name.startswith("test_")


def tests_module(rel: Path) -> str | None:
    """The held-out module a test file tests (test_json/..., test_csv.py), if any."""
    for part in rel.parts:
        stem = part.removesuffix(".py")
        if stem.startswith("test_"):
            name = stem.removeprefix("test_")
            for h in HELD_OUT:
                if name == h.removesuffix(".py"):
                    return h
    return None


def stdlib_files(root: Path, with_tests: bool) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib source file used, sorted by path."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "site-packages" or any(p in SKIP_DIRS - TEST_DIRS for p in rel.parts[:-1]):
            continue
        if is_test(rel) and (not with_tests or tests_module(rel) is not None):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append((rel.as_posix(), text.replace("\r\n", "\n")))
    return out


def windows(text: str, rng: random.Random) -> list[tuple[str, str]]:
    """(prefix, continuation) pairs walking a file front to back: a prefix of 6-30 whole lines (at
    most PREFIX_CHARS, whole lines dropped from its start), then the lines up to the next blank line
    (at most CONT_LINES). The next window starts where the continuation ended."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        b = i + rng.randint(*PREFIX_LINES)
        while b < len(lines) and not lines[b].strip():  # a continuation starts on a non-blank line
            b += 1
        if b >= len(lines):
            break
        j = b
        while j < len(lines) and j - b < CONT_LINES and lines[j].strip():
            j += 1
        prefix = lines[i:b]
        while len(prefix) > 1 and sum(len(s) + 1 for s in prefix) > PREFIX_CHARS:
            prefix = prefix[1:]
        if sum(len(s) + 1 for s in prefix) <= PREFIX_CHARS and any(s.strip() for s in prefix):
            out.append(("\n".join(prefix), "\n".join(lines[b:j])))
        i = j
    return out


def conversation(prefix: str, continuation: str | None) -> list[dict]:
    msgs = [{"role": "user", "content": prefix}]
    if continuation is not None:
        msgs.append({"role": "assistant", "content": continuation})
    return msgs


def split_corpus(files: list[tuple[str, str]], also: frozenset[str] = frozenset()) -> tuple[list, list]:
    """(training files, held-out files): HELD_OUT's modules are held out, and the paths in `also`."""
    held = {h for h in HELD_OUT}
    kept = [(p, t) for p, t in files if module_of(Path(p)) not in held and p not in also]
    test = [(p, t) for p, t in files if module_of(Path(p)) in held or p in also]
    return kept, test


def long_code_split(files: list[tuple[str, str]]) -> tuple[frozenset[str], list[str]]:
    """(paths, modules) the ``long`` size holds out beside HELD_OUT: every file whose dotted module
    name is on the eval side of the ``long-code`` set's module split (`code_prompts.held_out_module`;
    the set's modules are among them), and every test file named for such a module
    (``test_minidom.py`` for ``xml.dom.minidom``); the modules are the eval side's, test files aside."""
    from dflash_cache.eval import code_prompts

    names = {p: code_prompts.module_name("stdlib", Path(p)) for p, _ in files}
    held = {p for p, name in names.items() if code_prompts.held_out_module(name)}
    modules = sorted({names[p] for p in held if not is_test(Path(p))})
    tested = {m.rsplit(".", 1)[-1] for m in modules} | {m.replace(".", "_") for m in modules}
    for p, _ in files:
        named = {x.removesuffix(".py").removeprefix("test_") for x in Path(p).parts if x.startswith("test_")}
        if is_test(Path(p)) and named & tested:
            held.add(p)
    return frozenset(held), modules


def all_windows(files: list[tuple[str, str]], seed: int) -> list[tuple[str, str, str]]:
    """(path, prefix, continuation) of every file, each file's windows from its own seeded RNG (so
    one file's windows do not depend on which other files exist)."""
    out = []
    for path, text in files:
        rng = random.Random(f"{seed}:{path}")
        out.extend((path, p, c) for p, c in windows(text, rng))
    return out


# ----------------------------------------------------------------------------- tokenizer, model


def build_tokenizer(texts: list[str], bpe_vocab: int, max_length: int = COMMON["max_position_embeddings"]):
    """The tiny target's byte-level BPE (no mask token: the drafter's mask id is len(tokenizer))."""
    return byte_bpe_tokenizer(texts, bpe_vocab, SPECIAL_TOKENS, mask_token=None, max_length=max_length)


def build_model(tokenizer, size: Size):
    """The untrained model, float32, initialised from SEED. Its table has rows past the tokenizer,
    so the mask id of a drafter is len(tokenizer), a row no text produces."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = -(-(len(tokenizer) + 1) // 64) * 64
    config = Qwen3Config(vocab_size=vocab, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="bfloat16", **size.geometry,
                         **(COMMON | {"max_position_embeddings": size.positions}))  # fmt: skip
    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(config).float()


def encode(convs: list[list[dict]], tokenizer) -> list[list[int]]:
    """Each conversation as ``dflash extract`` renders it: the whole chat, no generation prompt."""
    texts = tokenizer.apply_chat_template(convs, tokenize=False)
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def module_pieces(text: str, offsets: list[int], budget: int, rng: random.Random) -> list[tuple[str, str]]:
    """(code, continuation) pairs covering a module front to back: consecutive runs of whole lines of
    at most `budget` tokens (`offsets`: where each of the module's tokens starts), each cut at a
    seeded line into the code the prompt shows and the reply that continues it. A line longer than
    the budget on its own is skipped."""
    lines = text.splitlines(keepends=True)  # as long_code cuts its prompts
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    before = [bisect.bisect_left(offsets, c) for c in starts]  # tokens before each line
    out, i = [], 0
    while i < len(lines):
        j = max(i + 1, bisect.bisect_right(before, before[i] + budget) - 1)
        if j - i >= 2:
            cut = rng.randint(i + 1, j - 1)
            code, rest = "".join(lines[i:cut]), "".join(lines[cut:j])
            if code.strip() and rest.strip():
                out.append((code, rest))
        i = j
    return out


def long_sequences(files: list[tuple[str, str]], tokenizer, longest: int, seed: int) -> list[list[int]]:
    """Every module of `files`, whole, as "continue this Python file" conversations: the user turn
    `long_code.continue_user` of a piece's code (the ``long-code`` set's prompt), the assistant turn
    its continuation (`module_pieces`; each file's cuts from its own seeded RNG), rendered as
    ``dflash extract`` renders them, at most `longest` tokens each."""
    from dflash_cache.eval.long_code import continue_user

    encodings = tokenizer.backend_tokenizer.encode_batch([t for _, t in files], add_special_tokens=False)
    convs = []
    for (path, text), enc in zip(files, encodings, strict=True):
        rng = random.Random(f"{seed}:long:{path}")
        pieces = module_pieces(text, [a for a, _ in enc.offsets], longest - LONG_SLACK, rng)
        convs += [conversation(continue_user(code), rest) for code, rest in pieces]
    return [s for s in encode(convs, tokenizer) if len(s) <= longest]


def causal_batches(batches: list) -> list:
    """`batches` with every attention mask all ones. Their padding is on the right, so in a causal
    LM no real token attends to it, and it has no labels: the loss and the gradients are the masked
    batch's, while attention takes its causal kernel rather than a mask of the sequence's length
    squared for every row."""
    return [(ids, att.new_ones(att.shape), labels) for ids, att, labels in batches]


def sample(model, tokenizer, prefix: str, device, max_new_tokens: int = 80) -> str:
    import torch

    enc = tokenizer.apply_chat_template(conversation(prefix, None), tokenize=True, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**enc.to(device), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=False)


# ----------------------------------------------------------------------------- outputs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def pick(items: list, n: int, seed: str) -> list:
    """n items in a seeded order (all of them if fewer)."""
    idx = list(range(len(items)))
    random.Random(seed).shuffle(idx)
    return [items[i] for i in sorted(idx[:n])]


def data_rows(train_w: list, test_w: list, size: Size) -> tuple[list[dict], list[dict]]:
    """Regen input (training-module prefixes with their original continuations) and eval prompts
    (held-out prefixes whose continuation has at least 3 lines, so there is something to draft)."""
    train_rows = [{"messages": conversation(p, c), "source": path} for path, p, c in
                  pick(train_w, size.train_rows, f"{SEED}:train-rows")]  # fmt: skip
    long = [w for w in test_w if w[2].count("\n") >= 2]
    prompt_rows = [{"messages": conversation(p, None), "reference": c, "source": path} for path, p, c in
                   pick(long, size.prompt_rows, f"{SEED}:prompt-rows")]  # fmt: skip
    return train_rows, prompt_rows


def write_data(data_dir: Path, train_rows: list[dict], prompt_rows: list[dict]) -> None:
    write_jsonl(data_dir / "code_train.jsonl", train_rows)
    write_jsonl(data_dir / "code_prompts.jsonl", prompt_rows)
    print(f"wrote {data_dir / 'code_train.jsonl'} ({len(train_rows)} rows), "
          f"{data_dir / 'code_prompts.jsonl'} ({len(prompt_rows)} rows)")  # fmt: skip


def whole_module_info(model, tokenizer, size: Size, test_files: list[tuple[str, str]], long_seqs: list[list[int]],
                      split: tuple[frozenset[str], list[str]], device) -> dict:  # fmt: skip
    """corpus.json's record of the long size: its positions, long-code's side of the module split
    held out (`long_code_split`), and the whole-module conversations with the trained model's loss
    on the held-out modules' (in bf16)."""
    longest = min(size.positions, size.batch_tokens)
    test_long = long_sequences(test_files, tokenizer, longest, SEED)
    batches = causal_batches(make_batches(test_long, tokenizer.pad_token_id, size.batch_tokens))
    loss = corpus_loss(model, batches, device)
    print(f"held-out loss of whole modules in bf16 {loss:.4f}")
    return {
        "positions": size.positions,
        "long_code_split": {"rule": "long-code's held-out modules (code_prompts.held_out_module: 15% of dotted "
                                    "module names by a sha256), with the test files named for them",
                            "modules": split[1], "paths": sorted(split[0])},
        "whole_modules": {"longest": longest, "train": len(long_seqs), "held_out": len(test_long),
                          "tokens": {"train": sum(map(len, long_seqs)), "held_out": sum(map(len, test_long))},
                          "held_out_loss_bf16": round(loss, 4)},
    }  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--out", type=Path, help="model directory (default data/code-target for cpu)")
    ap.add_argument("--data-dir", type=Path, help="where code_train.jsonl / code_prompts.jsonl go (default: "
                    "data/ for cpu, the model directory for gpu and long)")  # fmt: skip
    ap.add_argument("--steps", type=int, help="training steps (default: the size's)")
    ap.add_argument("--batch-tokens", type=int, help="padded tokens a batch (default: the size's; for long, "
                    "also the longest whole-module sequence when fewer than its 32,768 positions)")  # fmt: skip
    ap.add_argument("--time-budget", type=float, help="seconds of training: fewer steps if they do not fit")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: the size's)")
    ap.add_argument("--data-only", action="store_true", help="write the data files only (no tokenizer or model)")
    ap.add_argument("--stdlib", type=Path, default=None, help="standard library root (default: this interpreter's)")
    ap.add_argument("--geometry", type=json.loads, default={}, help="JSON object of Qwen3Config fields that "
                    "replace the size's (e.g. a toy model for a trial run)")  # fmt: skip
    return ap.parse_args()


def chosen_size(args: argparse.Namespace) -> Size:
    """The size asked for, with the command line's overrides."""
    size = SIZES[args.size]
    if args.batch_tokens:
        size = replace(size, batch_tokens=args.batch_tokens)
    if args.geometry:
        size = replace(size, geometry=size.geometry | args.geometry)
    return size


def main() -> None:
    args = parse_args()
    size = chosen_size(args)
    out = args.out or (HERE / "code-target" if args.size == "cpu" else Path(f"code-target-{args.size}"))
    data_dir = args.data_dir or (HERE if args.size == "cpu" else out)
    steps = args.steps or size.steps

    import torch

    device = torch.device("cuda" if args.size != "cpu" and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads or size.threads)
    torch.set_flush_denormal(True)  # tiny activations and Adam states turn denormal: a CPU slows down tenfold
    root = args.stdlib or stdlib_root()
    t0 = time.perf_counter()
    files = stdlib_files(root, size.with_tests)
    also, split_modules = long_code_split(files) if size.whole_modules else (frozenset(), [])
    train_files, test_files = split_corpus(files, also)
    train_w, test_w = all_windows(train_files, SEED), all_windows(test_files, SEED)
    if args.data_only:  # the rows depend on the corpus and the seed only, not on the model
        write_data(data_dir, *data_rows(train_w, test_w, size))
        return
    tokenizer = build_tokenizer([t for _, t in train_files], size.bpe_vocab, size.positions)
    seqs = [s for s in encode([conversation(p, c) for _, p, c in train_w], tokenizer) if len(s) <= MAX_TOKENS]
    test_seqs = [s for s in encode([conversation(p, c) for _, p, c in test_w], tokenizer) if len(s) <= MAX_TOKENS]
    longest = min(size.positions, size.batch_tokens)
    long_seqs = long_sequences(train_files, tokenizer, longest, SEED) if size.whole_modules else []
    batches = make_batches(seqs + long_seqs, tokenizer.pad_token_id, size.batch_tokens)
    if size.whole_modules:
        batches = causal_batches(batches)
    n_tokens = sum(map(len, seqs + long_seqs))
    print(f"corpus: {len(train_files)} training files, {len(test_files)} held out; {len(seqs + long_seqs)} "
          f"conversations, {n_tokens:,} tokens, {len(batches)} batches ({steps * size.batch_tokens / n_tokens:.2f} "
          f"epochs); prepared in {time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    if size.whole_modules:
        print(f"whole modules: {len(long_seqs)} conversations of up to {longest:,} tokens, "
              f"{sum(map(len, long_seqs)):,} tokens; {len(also)} files of long-code's side held out", flush=True)

    model = build_model(tokenizer, size).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, vocab {len(tokenizer)} in {model.config.vocab_size} rows, {device}")
    start = time.perf_counter()
    last, steps = train(model, batches, steps, lr=size.lr, device=device, time_budget=args.time_budget)
    took = time.perf_counter() - start
    model = model.to(torch.bfloat16)
    test_loss = corpus_loss(model, make_batches(test_seqs, tokenizer.pad_token_id, size.batch_tokens), device)
    print(f"trained in {took:.0f}s: recent training loss {last:.4f}; held-out loss in bf16 {test_loss:.4f}")
    long_info = {}
    if size.whole_modules:
        long_info = whole_module_info(model, tokenizer, size, test_files, long_seqs, (also, split_modules), device)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    train_rows, prompt_rows = data_rows(train_w, test_w, size)
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "size": args.size,
        "held_out_modules": list(HELD_OUT),
        "files": {"train": len(train_files), "held_out": len(test_files),
                  "held_out_paths": [p for p, _ in test_files],
                  "digest": hashlib.sha256("".join(p + t for p, t in files).encode()).hexdigest()[:16]},
        "with_tests": size.with_tests,
        "conversations": {"train": len(seqs), "held_out": len(test_seqs)},
        "tokens": {"train": sum(map(len, seqs)), "held_out": sum(map(len, test_seqs))},
        "parameters": n_params,
        "steps": steps,
        "time_budget": args.time_budget,
        "batch_tokens": size.batch_tokens,
        "epochs": round(steps * size.batch_tokens / n_tokens, 3),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "device": str(device),
        "train_seconds": round(took, 1),
        "loss": {"train_recent": round(last, 4), "held_out_bf16": round(test_loss, 4)},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "data": {"train_rows": len(train_rows), "prompt_rows": len(prompt_rows)},
    } | long_info  # fmt: skip
    (tmp / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_data(data_dir, train_rows, prompt_rows)
    size_b = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size_b / 1024:.0f} KiB)")
    print("greedy sample on a held-out prefix:\n" + prompt_rows[0]["messages"][0]["content"][-300:]
          + "\n----- target:\n" + sample(model, tokenizer, prompt_rows[0]["messages"][0]["content"], device))


if __name__ == "__main__":
    main()
