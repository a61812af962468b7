"""Real prompts that nobody here wrote, for the real-model study (``benchmarks/real_model_study.py``) and
docs/guides/gguf-smollm2.md, read from the running interpreter, offline:

- ``train``: "complete this function" prompts from the standard library's and site-packages'
  functions, HumanEval left out (`dflash_cache.eval.code_prompts`, which `dflash recipe` uses too);
- ``humaneval``: HumanEval's 164 prompts in the same user message (`dflash_cache.eval.benchsets`), the
  held-out eval.

Usage::

    python benchmarks/make_real_prompts.py train --out prompts.jsonl [--roots stdlib,site-packages] [--procs 8]
    python benchmarks/make_real_prompts.py humaneval --out humaneval.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_cache.eval import benchsets, code_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="complete-this-function prompts from the stdlib and site-packages")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--roots", default=",".join(code_prompts.ROOTS), help="stdlib, site-packages and/or directories")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--procs", type=int, default=1, help="processes that parse the files")
    h = sub.add_parser("humaneval", help="HumanEval's 164 prompts (the held-out eval)")
    h.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.what == "train":
        manifest = code_prompts.build(a.out, roots=a.roots.split(","), seed=a.seed, procs=a.procs)
        print(json.dumps(manifest, indent=1))
    else:
        _, rows = benchsets.set_rows("humaneval")
        benchsets.write_rows(rows, a.out)
        print(f"{len(rows)} HumanEval prompt rows in {a.out}")


if __name__ == "__main__":
    main()
