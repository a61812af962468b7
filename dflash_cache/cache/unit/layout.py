"""The row layout: which arrays a cached token has, and their dtypes and shapes.

Hidden states are stored per token as the K tapped layers side by side (`RowFormat`): bf16 bits,
or float8_e4m3fn bits with one float32 scale per token and layer. A cache extracted with
`--final-hidden` also holds the target's last hidden state after its final norm (the LM head's
input) in arrays of its own, `final_hidden` and (fp8) `final_scale`, in the same storage, so a
drafter that does not need it never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dflash_cache.cache.spec import CacheSpec, ProjectionInfo

if TYPE_CHECKING:  # torch is imported where it is used: unit writer processes never load it
    import torch

TOKEN_ARRAYS = ("hidden", "hidden_scale", "final_hidden", "final_scale", "input_ids", "loss_mask")
FINAL_ARRAYS = ("final_hidden", "final_scale")  # the final hidden state of a `--final-hidden` cache
STORAGES = ("bf16", "fp8")
ID_MASK_BYTES = 4 + 1  # input_ids (int32) and loss_mask (uint8) of one token


@dataclass(frozen=True)
class RowFormat:
    """One cached token: `layers` (K) tapped layers of `width // layers` values each, in `storage`,
    and with `final` > 0 the target's final hidden state of `final` (H) values. Under a projection
    the "layers" are its groups of projected values (`CacheSpec.groups`): one for a joint basis."""

    storage: str
    width: int  # K*H stored values per token
    layers: int  # K
    final: int = 0  # H when the final hidden state is cached, else 0

    @classmethod
    def of(cls, spec: CacheSpec) -> RowFormat:
        return cls.planned(spec.storage.dtype, len(spec.layers.ids), spec.target.hidden_size, spec.projection,
                           final=spec.layers.final_hidden)  # fmt: skip

    @classmethod
    def planned(cls, storage: str, num_layers: int, hidden_size: int, projection: ProjectionInfo | None = None,
                final: bool = False) -> RowFormat:  # fmt: skip
        """The row of K = `num_layers` taps of H = `hidden_size`, as they are or under `projection`:
        what a plan sizes its units by before the cache's spec exists."""
        if projection is None:
            return cls(storage, num_layers * hidden_size, num_layers, hidden_size if final else 0)
        groups = len(projection.groups(num_layers))
        return cls(storage, projection.rank, groups, hidden_size if final else 0)

    @property
    def fp8(self) -> bool:
        return self.storage == "fp8"

    @property
    def hidden_dtype(self) -> np.dtype:
        """The hidden array's dtype on disk: fp8 bits, or bf16 bits (numpy has no bfloat16)."""
        return np.dtype(np.uint8 if self.fp8 else np.uint16)

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one token's hidden states (all K layers)."""
        return self.width * self.hidden_dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        return 4 * self.layers if self.fp8 else 0

    @property
    def final_bytes(self) -> int:
        """Bytes of one token's final hidden state with its fp8 scale (0 when it is not cached):
        H * 2 in bf16, H + 4 in fp8."""
        return self.final * self.hidden_dtype.itemsize + (4 if self.fp8 and self.final else 0)

    @property
    def row_bytes(self) -> int:
        """Uncompressed bytes of one cached token, every array included."""
        return self.hidden_bytes + self.scale_bytes + self.final_bytes + ID_MASK_BYTES

    def expected(self, n_tokens: int) -> Expect:
        """The token-wise arrays a unit of `n_tokens` tokens must hold."""
        expect: Expect = {
            "hidden": (self.hidden_dtype, (n_tokens, self.width)),
            "input_ids": (np.dtype(np.int32), (n_tokens,)),
            "loss_mask": (np.dtype(np.uint8), (n_tokens,)),
        }
        if self.fp8:
            expect["hidden_scale"] = (np.dtype(np.float32), (n_tokens, self.layers))
        if self.final:
            expect["final_hidden"] = (self.hidden_dtype, (n_tokens, self.final))
            if self.fp8:
                expect["final_scale"] = (np.dtype(np.float32), (n_tokens, 1))
        return expect

    def shapes(self, rows: int) -> dict[str, tuple[tuple[int, int], str]]:
        """The hidden-state arrays of `rows` tokens as (shape, torch dtype name): what extract's
        unit buffers and the loader's host slots hold. bf16 bits live in int16, which torch can view
        as bfloat16 (it has no full uint16 support)."""
        bits = "uint8" if self.fp8 else "int16"
        out = {"hidden": ((rows, self.width), bits)}
        if self.fp8:
            out["hidden_scale"] = ((rows, self.layers), "float32")
        if self.final:
            out["final_hidden"] = ((rows, self.final), bits)
            if self.fp8:
                out["final_scale"] = ((rows, 1), "float32")
        return out


def host_rows(rows: int, row: RowFormat, pin: bool = False) -> dict[str, torch.Tensor]:
    """Host tensors for `rows` tokens of every hidden-state array of `row` (storage bits, fp8
    scales, the final state), by array name; pinned for async copies."""
    import torch

    return {key: torch.empty(shape, dtype=getattr(torch, dtype), pin_memory=pin)
            for key, (shape, dtype) in row.shapes(rows).items()}  # fmt: skip


def chunk_tokens_for(row_bytes: int, target_bytes: int = 4 << 20) -> int:
    """Tokens per inner chunk so that a chunk of hidden states is about `target_bytes`."""
    return max(16, target_bytes // max(1, row_bytes))


Expect = dict[str, tuple[np.dtype, tuple[int, ...]]]  # array name -> (dtype, shape) a reader requires
