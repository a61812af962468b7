"""`dflash convert`: a GGUF checkpoint -> a Hugging Face model directory, once.

Every stage that loads the target (extract, regen, eval), the serving engines, the reference
DFlash code and the cache's weights fingerprint read a Hugging Face directory of safetensors. A
GGUF file is converted to one once, rather than read by each stage: transformers dequantizes a
GGUF on every load (about 30 s for the 135M SmolLM2 on 2 CPU cores, against under a second for
its safetensors), and the cache fingerprints safetensors. A ``.gguf`` given as ``--target`` is
refused with the command that converts it (``target/load.py``).

transformers reads the GGUF (``from_pretrained(dir, gguf_file=...)``, through the ``gguf``
package, which needs ``accelerate``); the quantization config is dropped so that the directory
saves and loads as a plain model, of ``dtype`` weights. The directory holds ``config.json``,
``model.safetensors``, the tokenizer with its chat template, ``generation_config.json`` and
``dflash_convert.json`` (the source file, its fingerprint and the dtype). Before the directory is
renamed into place, the saved model is loaded back and its logits on a probe conversation are
compared with those of the model as read from the GGUF.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_cache.core.damage import damaged, read_json, reason
from dflash_cache.core.errors import UserError
from dflash_cache.core.paths import output_dir

RECORD = "dflash_convert.json"
DTYPES = ("bfloat16", "float32")
PROBE = [
    {"role": "user", "content": "Write a Python function that reverses a string."},
    {"role": "assistant", "content": 'def reverse(s: str) -> str:\n    """Return s reversed."""\n    return s[::-1]'},
]


class ConvertError(UserError, ValueError):
    """A GGUF that cannot be converted as asked; the message says why."""


def find_gguf(path: str | Path) -> Path:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file of a directory."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if found:
            raise ConvertError(f"{p} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}); "
                               "name one")  # fmt: skip
        raise ConvertError(f"{p} holds no .gguf file")
    raise ConvertError(f"{p} does not exist" if not p.exists() else f"{p} is not a .gguf file")


def fingerprint(path: Path) -> str:
    """The file's size and the sha256 of its first and last MiB: cheap, and changes with any
    re-quantization (the header and the tensor data both move)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert(gguf: str | Path, out: str | Path, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """Write the HF directory `out` for the GGUF `gguf` (a file or a directory holding one). A
    directory already converted from the same file with the same dtype is kept as it is."""
    src, out = find_gguf(gguf), output_dir(out, "OUT")
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected {' or '.join(DTYPES)}")
    record = {"source": str(src.resolve()), "fingerprint": fingerprint(src), "dtype": dtype}
    if (out / RECORD).is_file():
        old = read_json(out / RECORD, f"delete OUT {out} to convert again")
        if {k: old.get(k) for k in ("fingerprint", "dtype")} == {k: record[k] for k in ("fingerprint", "dtype")}:
            return {"out": str(out), "reused": True, **old}
        raise ConvertError(f"OUT {out} holds a conversion of another file or dtype ({old.get('source')}, "
                           f"{old.get('dtype')}); use another OUT or delete it")  # fmt: skip
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"OUT {out} is a non-empty directory that is not a conversion")
    check_gguf(src)
    t0 = time.perf_counter()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        check = _write(src, tmp, dtype)
        (tmp / RECORD).write_text(json.dumps({**record, "check": check}, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "reused": False, **record, "check": check, "seconds": time.perf_counter() - t0}


def check_gguf(src: Path) -> None:
    """Refuse a GGUF that is cut short (a download that stopped) or not a GGUF at all, naming it,
    before transformers reads it, whose reader fails on one with the words of `struct` ("requires a
    buffer of at least ...") or worse, reads on. The header and tensor table must parse (the gguf
    package's reader, about a second for SmolLM2), and every tensor's bytes must lie in the file."""
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers' own load says what to install
        return
    fix = "download or copy it again"
    size = src.stat().st_size
    try:
        reader = GGUFReader(src)
    except (OSError, ValueError, KeyError, IndexError, struct.error) as e:  # its parser at a cut or in garbage
        raise damaged(src, "GGUF file", f"its header and tensor table do not parse in its {size:,} bytes: "
                      f"{reason(e)}", fix) from None  # fmt: skip
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise damaged(src, "GGUF file", f"its tensors end at byte {end:,} and the file has {size:,}", fix)


def _write(src: Path, out: Path, dtype: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _name_maps_cached():
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            # read in float32, the GGUF's own dequantized values, which the check compares against
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except ImportError as e:  # gguf or accelerate missing
        raise ConvertError(f"{src}: {e} (pip install gguf accelerate)") from None
    except (OSError, ValueError, KeyError, struct.error) as e:  # struct: transformers' own GGUF reader
        raise ConvertError(f"{src}: transformers cannot read it ({str(e).strip().splitlines()[0]})") from None
    model.eval()
    text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = model(ids).logits[0]
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are saved dequantized: a plain model
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.config.name_or_path = src.stem
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = saved(ids).logits[0]
    check = {"probe_tokens": ids.shape[1], "top1_agreement": float((want.argmax(-1) == got.argmax(-1)).float().mean()),
             "relative_error": float((want - got).norm() / want.norm())}  # fmt: skip
    if check["top1_agreement"] < 0.95 or check["relative_error"] > 0.02:  # bf16 rounding alone: about 0.006
        raise ConvertError(f"{src}: the saved model does not reproduce the GGUF's logits ({check}); not converted")
    return check


@contextmanager
def _name_maps_cached():
    """transformers builds gguf's tensor-name map of the architecture once per tensor (397 times
    for SmolLM2, half of the load); it is a pure function of (architecture, layers), so cache it."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original
