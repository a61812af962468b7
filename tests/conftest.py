"""Fixtures and hooks. The fixtures are built once a session (once a pytest-xdist worker) and read,
never changed, by the tests: caches extracted from the bundled data (all of it, with and without the
final hidden state, and a small one of several units), the hybrid family targets, the real SmolLM2
converted. The plain helpers the test modules import are in helpers.py."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import CHAT, extract_config, jsonl_head, smollm2_gguf

# Under pytest-xdist (`-n 2`: one worker a core) every process of the suite, the workers and the
# commands they start, runs one torch thread: two workers of two threads each on two cores thrash,
# and a run that takes as many threads as cores are idle when it starts would sum in another
# order than its reference and differ in the last bits.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _triton_interpreter() -> None:
    """Without a GPU, Triton's language module loads with its interpreter on, so that
    tests/test_slot_kernel.py can run the GPU kernels on the CPU (TRITON_INTERPRET must be set when it
    loads); the variable is unset again, so that nothing else, the commands the tests start
    included, runs them there."""
    if importlib.util.find_spec("triton") is None:
        return
    import torch

    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        del os.environ["TRITON_INTERPRET"]


_triton_interpreter()


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter for a test's kernels (the module's top loads Triton for it). Its dot
    product is replaced by one that, like a GPU's matrix instructions, computes each output row from
    its own input row alone (numpy's matrix product may sum a row in another order by its place in
    the tile), and that widens bfloat16 operands to float32 first (exact), where the interpreter's
    own reads their raw 16-bit patterns (Triton 3.9)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs these kernels compiled (tests/test_gpu.py)")
    pytest.importorskip("triton", reason="the kernels need Triton (pip install triton); its interpreter runs them")
    from triton.runtime import interpreter as interp

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def dot(self, a, b, d, *args):
        a, b = (x.data if x.data.dtype != np.uint16 else (x.data.astype(np.uint32) << 16).view(np.float32)
                for x in (a, b))  # fmt: skip
        batched = a.ndim == 3  # a batch of products, [batch, M, K] x [batch, K, N]
        a, b = (a, b) if batched else (a[None], b[None])
        out = np.stack([np.stack([np.matmul(row[None], bb, dtype=d.data.dtype)[0] for row in aa])
                        for aa, bb in zip(a, b, strict=True)])  # fmt: skip
        return interp.TensorHandle((out if batched else out[0]) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", dot)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A complete bf16 cache of the bundled chat data (several units), shared by the session."""
    from dflash_cache.extract.stage import run

    out = tmp_path_factory.mktemp("cache") / "cache"
    run(extract_config(out))
    return out


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory) -> Path:
    """The bundled chat data's first 60 rows in units of 1 MiB and batches of 512 tokens (several
    units of a few samples): the finished cache that kill, resume and sharding tests train on or
    compare with. Tests that change a cache copy it first."""
    from dflash_cache.extract.stage import run

    root = tmp_path_factory.mktemp("small-cache")
    rows = root / "rows.jsonl"
    rows.write_text(jsonl_head(CHAT, 60))
    run(extract_config(root / "cache", data=str(rows), unit_mb=1, token_budget=512))
    return root / "cache"


@pytest.fixture(scope="session")
def hybrid_targets(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3.5-layout targets of family_targets.py, by family: "qwen3_5" (a text-only
    Qwen3_5ForCausalLM) and "qwen3_5_vl" (the hub checkpoints' multimodal layout)."""
    import family_targets as fam

    root = tmp_path_factory.mktemp("hybrids")
    return {f: fam.build(f, root / f) for f in fam.HYBRIDS}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2 target as a Hugging Face directory, converted once a session by
    `dflash convert`'s library call (bf16 weights; 20-30 s on 2 busy cores, most of it
    transformers reading the GGUF). Its dflash_convert.json records the time it took."""
    from dflash_cache.pipelines.convert import RECORD, convert

    out = tmp_path_factory.mktemp("smollm2") / "hf"
    t = time.perf_counter()
    convert(smollm2_gguf(), out)
    record = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**record, "test_fixture_seconds": time.perf_counter() - t}, indent=1))
    return out


@pytest.fixture(scope="session")
def final_cache(tmp_path_factory) -> Path:
    """`tiny_cache` extracted with --final-hidden (the same plan, units and taps), for DSpark."""
    from dflash_cache.extract.stage import run

    out = tmp_path_factory.mktemp("final-cache") / "cache"
    run(extract_config(out, final_hidden=True))
    return out
