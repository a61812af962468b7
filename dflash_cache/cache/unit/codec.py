"""The hidden states' storage: bf16 bits, or float8_e4m3fn bits with a float32 scale per token and
layer (amax / 448). `encode_hidden` and `decode_hidden` are the only code that converts between
the storages."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_cache.cache.unit.layout import RowFormat

if TYPE_CHECKING:  # torch is imported where it is used: unit writer processes never load it
    import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def encode_hidden(taps: list[torch.Tensor], index: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather the real (unpadded) rows of every tapped layer into [n, K*H] storage bits.

    bf16: the bf16 bits as int16. fp8: float8_e4m3fn bits as uint8 with a float32 scale per
    token and layer (amax / 448), computed on the device so the host copy is halved too.
    """
    import torch

    rows = [t.reshape(-1, t.shape[-1]).index_select(0, index) for t in taps]
    if not fp8:
        return torch.cat(rows, dim=1).to(torch.bfloat16).view(torch.int16), None
    h = torch.stack(rows, dim=1).float()  # [n, K, H]
    scale = h.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (h / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.reshape(q.shape[0], -1), scale


def encode_rows(outputs: list[torch.Tensor], index: torch.Tensor, row: RowFormat) -> dict[str, torch.Tensor]:
    """A target forward's outputs (the K tapped layers, then the final hidden state when `row`
    caches it), unpadded by `index`, as storage arrays by name (the keys of `row.shapes`)."""
    taps = outputs[: row.layers]
    bits, scale = encode_hidden(taps, index, row.fp8)
    out = {"hidden": bits} if scale is None else {"hidden": bits, "hidden_scale": scale}
    if row.final:
        if len(outputs) != row.layers + 1:
            raise ValueError(f"the target gave {len(outputs)} outputs; {row.layers} taps and the final state expected")
        bits, scale = encode_hidden(outputs[row.layers :], index, row.fp8)
        out["final_hidden"] = bits
        if scale is not None:
            out["final_scale"] = scale
    return out


def decode_hidden(bits: torch.Tensor, scale: torch.Tensor | None, num_layers: int,
                  layer_index: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `encode_hidden`: storage bits -> [n, K'*H], bf16 (bf16 storage) or float32
    (fp8), keeping only the layers in `layer_index` (all when None)."""
    import torch

    n = bits.shape[0]
    if scale is None:
        bf16 = bits.view(torch.bfloat16)
        if layer_index is None:
            return bf16
        return bf16.view(n, num_layers, -1).index_select(1, layer_index).reshape(n, -1)
    q = bits.view(torch.float8_e4m3fn).view(n, num_layers, -1)
    if layer_index is not None:
        q, scale = q.index_select(1, layer_index), scale.index_select(1, layer_index)
    return (q.float() * scale.unsqueeze(-1)).reshape(n, -1)
