"""The cache's projection basis (docs/reference/projection.md): fitted, stored, applied, folded.

Both drafter families read the cached layers through one bias-free linear map first,
`fc: K*H -> H`. So a cache may hold `z = W x` per token instead of the K tapped layers `x`: the
drafter trains `fc'` on `z`, and the export writes `fc = fc' W`, which computes on the full
features exactly what training computed on `z`. Nothing is approximated; `fc` is only restricted
to W's row space, and W is fitted so that this space holds almost all of the features' energy.

W is stored as groups (`ProjectionInfo.groups`): one `[rank, K*H]` matrix over the K layers
together (joint), or K matrices `[rank / K, H]`, one a layer (per-layer). `fit` makes W from the
second moment of the target's own features on a sample of the run's data: each layer divided by
its RMS (a diagonal W absorbs), then the top eigenvectors. `projection.safetensors` holds W; its
digest is in cache.json, so a damaged or swapped basis is found (`dflash verify`) rather than
trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dflash_cache.cache.spec import BASES, SCALINGS, CacheSpec, ProjectionInfo
from dflash_cache.core.atomic import replacing
from dflash_cache.core.damage import load_safetensors
from dflash_cache.core.errors import UserError

PROJECTION = "projection.safetensors"


class CorruptBasis(UserError, RuntimeError):
    """A projected cache's basis that is missing, unreadable, or not the one its units were made with."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


@dataclass
class Basis:
    """W as groups: `weights[g]` [r_g, len(groups[g]) * H] (float32) maps group g's tapped layers
    (positions among the cache's layers, side by side) to its r_g stored values."""

    weights: list[Tensor]
    groups: list[list[int]]
    _cast: dict = field(default_factory=dict, repr=False)  # W's blocks by (device, dtype), made once

    @property
    def rank(self) -> int:
        return sum(w.shape[0] for w in self.weights)

    def matrix(self, groups: list[int] | None = None) -> Tensor:
        """W of the chosen groups (all when None) as one block-diagonal matrix [sum r_g, sum |g| H]:
        what a drafter reading those groups folds into its `fc`."""
        chosen = [self.weights[g] for g in (range(len(self.weights)) if groups is None else groups)]
        return torch.block_diag(*chosen)

    def project(self, taps: list[Tensor]) -> list[Tensor]:
        """The tapped layers' hidden states ([..., H] each, in the cache's layer order) as each
        group's stored values [..., r_g], in the taps' dtype: `z_g = sum over layers l of g of
        x_l W_g[:, l]^T`, without concatenating the layers first."""
        key = (taps[0].device, taps[0].dtype)
        if key not in self._cast:
            self._cast[key] = [[b.to(key[0], key[1]).T.contiguous() for b in w.chunk(len(g), dim=1)]
                               for w, g in zip(self.weights, self.groups, strict=True)]  # fmt: skip
        out = []
        for blocks, members in zip(self._cast[key], self.groups, strict=True):
            z = taps[members[0]] @ blocks[0]
            flat = z.view(-1, z.shape[-1])  # z is fresh and contiguous: accumulate into it in place
            for block, layer in zip(blocks[1:], members[1:], strict=True):
                flat.addmm_(taps[layer].reshape(-1, taps[layer].shape[-1]), block)
            out.append(z)
        return out

    def fold(self, fc_weight: Tensor, groups: list[int]) -> Tensor:
        """`fc = fc' W` [H, sum |g| H]: the `fc` weight on the full tapped layers of a drafter whose
        `fc'` [H, sum r_g] was trained on the chosen groups' stored values. Computed in float64."""
        w = self.matrix(groups).to(fc_weight.device, torch.float64)
        return (fc_weight.detach().to(torch.float64) @ w).to(fc_weight.dtype)

    def save(self, cache_dir: Path) -> str:
        """Write `projection.safetensors` atomically; returns its digest."""
        from safetensors.torch import save_file

        path = Path(cache_dir) / PROJECTION
        tensors = {f"w.{g}": w.detach().float().contiguous().cpu() for g, w in enumerate(self.weights)}
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata={"groups": json.dumps(self.groups)})
        return file_digest(path)

    @classmethod
    def load(cls, cache_dir: Path, spec: CacheSpec) -> Basis:
        """The basis a projected cache's units were made with, checked against cache.json's digest
        and geometry (CorruptBasis, naming the file, otherwise)."""
        proj = spec.projection
        assert proj is not None, "the cache is not projected"
        path = Path(cache_dir) / PROJECTION
        if not path.is_file():
            raise CorruptBasis(f"{path} is missing: the cache's units hold features projected with it, so they "
                               "cannot be trained on without it; restore it from a copy of the cache")  # fmt: skip
        if (got := file_digest(path)) != proj.digest:
            raise CorruptBasis(f"{path} is damaged or not this cache's (digest {got}, cache.json has "
                               f"{proj.digest}); restore it from a copy of the cache")  # fmt: skip
        tensors = load_safetensors(path, "restore it from a copy of the cache")
        groups = spec.groups
        weights = [tensors.get(f"w.{g}") for g in range(len(groups))]
        h = spec.target.hidden_size
        widths = [proj.rank // len(groups)] * len(groups)
        if any(w is None or tuple(w.shape) != (r, len(g) * h) for w, r, g in zip(weights, widths, groups, strict=True)):
            raise CorruptBasis(f"{path} does not hold the {proj.basis} basis of rank {proj.rank} that cache.json "
                               "describes; restore it from a copy of the cache")  # fmt: skip
        return cls(weights, groups)


def check_projection(basis: str, rank: int, scaling: str, num_layers: int, hidden_size: int) -> str | None:
    """Why a projection of `rank` values cannot be fitted for K = `num_layers` taps of H =
    `hidden_size` (None when it can)."""
    if basis not in BASES:
        return f"basis {basis!r}: expected {' or '.join(BASES)}"
    if scaling not in SCALINGS:
        return f"scaling {scaling!r}: expected {' or '.join(SCALINGS)}"
    width = num_layers * hidden_size
    if not 0 < rank < width:
        return f"rank {rank}: between 1 and {width - 1} (the {num_layers} x {hidden_size} tapped values)"
    if basis == "per-layer" and rank % num_layers:
        return f"rank {rank}: a per-layer basis stores rank / {num_layers} values a layer; give a multiple of it"
    return None


class Moments:
    """The second moment sum of x x^T of the tapped layers side by side, over the fit sample: all
    that fitting the basis needs. float64 on the CPU, float32 on a GPU (where float64 is slow)."""

    def __init__(self, num_layers: int, hidden_size: int, device: torch.device) -> None:
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.sum = torch.zeros(num_layers * hidden_size, num_layers * hidden_size, dtype=dtype, device=device)
        self.tokens = 0

    def add(self, taps: list[Tensor]) -> None:
        """Rows of real (unpadded) tokens of each tapped layer, [n, H] each."""
        x = torch.cat([t.to(self.sum.dtype) for t in taps], dim=1)
        self.sum.addmm_(x.T, x)
        self.tokens += x.shape[0]


def fit(moments: Moments, info: ProjectionInfo, num_layers: int) -> tuple[Basis, list[float]]:
    """W from the fit sample's second moment (the module docstring), and the share of each tapped
    layer's energy (after scaling) that W's row space keeps, on the fit sample."""
    m = moments.sum
    k, h = num_layers, m.shape[0] // num_layers
    energy = m.diagonal().view(k, h).sum(1)  # per layer: sum over tokens of |x_l|^2
    if info.scaling == "layer-rms":
        rms = (energy / max(moments.tokens * h, 1)).sqrt().clamp_min(1e-12)
    else:
        rms = torch.ones(k, dtype=m.dtype, device=m.device)
    inv = (1 / rms).repeat_interleave(h)
    scaled = m * inv[:, None] * inv[None, :]
    groups = info.groups(k)
    width = info.rank // len(groups)
    weights, kept = [], []
    for members in groups:
        idx = torch.cat([torch.arange(i * h, (i + 1) * h, device=m.device) for i in members])
        sub = scaled[idx][:, idx]
        _, vecs = torch.linalg.eigh(sub)
        top = vecs[:, -width:].flip(-1)  # [|g| H, r]: the top directions, largest first
        top = top * torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))  # a fixed sign each
        weights.append((top.T * inv[idx][None, :]).float().cpu())
        kept += _retained(sub, top, len(members))
    return Basis(weights, groups), kept


def _retained(m: Tensor, u: Tensor, num_layers: int) -> list[float]:
    """Per layer of a group: 1 - |x_l - (P x)_l|^2 / |x_l|^2 summed over the sample, with P = U U^T,
    from the group's second moment `m` alone."""
    a = u.T @ m  # [r, n]
    cross = (u * a.T).sum(1)  # diag(P M)
    both = ((u @ (a @ u)) * u).sum(1)  # diag(P M P)
    total = m.diagonal().view(num_layers, -1).sum(1)
    residual = (m.diagonal() - 2 * cross + both).view(num_layers, -1).sum(1)
    return [round(float(1 - r / t), 6) if t > 0 else 1.0 for r, t in zip(residual, total, strict=True)]
