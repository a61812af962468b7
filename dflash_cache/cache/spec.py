"""What a cache is: the `cache.json` contract, fingerprints, and compatibility checks.

`cache.json` is written once, when a cache is created, and never rewritten. It records everything
that decides what the cached numbers mean, so that a resumed extraction or a training run can
refuse a cache that does not match instead of training silently wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.errors import UserError

FORMAT_VERSION = 1  # a cache of the tapped layers as they are
PROJECTED_VERSION = 2  # a cache of the projected features (`projection`): readers before it must refuse it
VERSIONS = (FORMAT_VERSION, PROJECTED_VERSION)
CACHE_JSON = "cache.json"
LAYER_MEANING = (
    "layer id l is the output of decoder layer l (0-based), i.e. hidden_states[l + 1] of "
    "Hugging Face's output_hidden_states (index 0 is the embeddings)"
)
FINAL_MEANING = (
    "final_hidden: the target's last hidden state after its final norm, the LM head's input "
    "(the base model's last_hidden_state), for every token"
)
# Fields that describe a run rather than the cached numbers; they may differ on resume.
_VOLATILE = {"created", "tool_version", "parallel"}
# Fields that explain another field rather than decide anything (the id is compared, the reason
# for it is not; caches from before the field have none).
# The basis's digest and what its fit measured are checked against the basis file (`dflash verify`), not
# against a rerun's settings: a rerun takes the stored basis, it does not fit another.
_EXPLANATIONS = {"tokenizer.mask_token", "projection.digest", "projection.fitted_tokens", "projection.retained_energy"}
BASES = ("joint", "per-layer")
SCALINGS = ("layer-rms", "none")


class SpecError(UserError, ValueError):
    """A cache that cannot be used as asked: the message names the field."""


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """DFlash's default taps: K layers spread from layer 1 to layer L-3. A target too shallow for K
    distinct taps (fewer than K + 3 layers) gets the distinct ones, within its depth."""
    if k < 1:
        raise SpecError(f"layers: need at least one tapped layer, got {k}")
    if k == 1:
        return [num_layers // 2]
    span = num_layers - 4
    return sorted({min(max(int(round(1 + i * span / (k - 1))), 0), num_layers - 1) for i in range(k)})


def default_bucket_edges(max_length: int) -> list[int]:
    """Upper edges of the length buckets: powers of two, then steps of 512, up to max_length."""
    edges, e = [], 64
    while e < min(max_length, 1024):
        edges.append(e)
        e *= 2
    e = 1024
    while e < max_length:
        edges.append(e)
        e += 512
    return [*edges, max_length]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Validate user-given layer ids against the target's depth."""
    if not layer_ids:
        raise SpecError("layers: at least one layer id is needed")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise SpecError(f"layers: {bad} out of range for a target with {num_layers} layers (0..{num_layers - 1})")
    if len(set(layer_ids)) != len(layer_ids):
        raise SpecError(f"layers: duplicate ids in {layer_ids}")
    return sorted(layer_ids)


def digest(obj: Any) -> str:
    """A short stable digest of JSON-able data or bytes."""
    data = obj if isinstance(obj, bytes) else json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass
class TargetInfo:
    path: str
    revision: str | None
    weights_fingerprint: str
    config_digest: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    compute_dtype: str
    tied_embeddings: bool
    config: dict[str, Any] = field(default_factory=dict)  # the text model's config: the drafter's geometry


@dataclass
class LayerInfo:
    ids: list[int]
    meaning: str = LAYER_MEANING
    # `extract --final-hidden`: the units also hold the target's final hidden state (FINAL_MEANING).
    # Written to cache.json only when true, so a cache without it reads as it always did.
    final_hidden: bool = False


@dataclass
class StorageInfo:
    dtype: str  # "bf16" or "fp8"
    codec: dict[str, Any]  # e.g. {"name": "zstd", "level": 3, "checksum": true}
    chunk_tokens: int


@dataclass
class TokenizerInfo:
    digest: str
    chat_template_digest: str | None
    mask_token_id: int
    pad_token_id: int | None
    eos_token_ids: list[int]
    # passed to every apply_chat_template call (e.g. enable_thinking): they change the rendered tokens
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # how mask_token_id was chosen: {"id", "token", "rule", "reason"} (extract/mask.py); {} in older caches
    mask_token: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataInfo:
    source: str
    fingerprint: str
    max_length: int
    truncate: bool
    num_rows: int
    num_rejected: int
    filters: dict[str, Any] = field(default_factory=dict)
    split: str | None = None  # the split of a hub dataset or saved DatasetDict; None: its default
    max_samples: int | None = None  # only the first N rows of the source were read


@dataclass
class PlanInfo:
    bucket_edges: list[int]
    token_budget: int
    unit_tokens: int
    num_units: int
    num_samples: int
    num_tokens: int
    padded_tokens: int


@dataclass
class ProjectionInfo:
    """The fold (docs/reference/projection.md): the cache holds `z = W x` per token, not the tapped layers `x`.

    `W` (`projection.safetensors`, cache/projection.py) is fitted on the target's own features
    before the first unit: each tapped layer divided by its RMS (`scaling` "layer-rms"), then the
    top principal directions of their second moment, `rank` values in all: one basis over the K
    layers together ("joint"), or `rank / K` for each layer ("per-layer", which keeps layer subsets
    possible). A drafter trains its `fc` on `z`; the export folds it back (`fc = fc' W`)."""

    basis: str  # "joint" or "per-layer"
    rank: int  # stored values per token, all groups together
    scaling: str  # "layer-rms" or "none"
    fit_tokens: int  # the setting: tokens of the run's own data the basis is fitted on, at most
    digest: str = ""  # sha-256 prefix of projection.safetensors
    fitted_tokens: int = 0  # tokens it was fitted on
    retained_energy: list[float] = field(default_factory=list)  # per tapped layer, of the fit sample

    def groups(self, num_layers: int) -> list[list[int]]:
        """The tapped layers' positions that each stored group of values projects."""
        return [list(range(num_layers))] if self.basis == "joint" else [[i] for i in range(num_layers)]


@dataclass
class CacheSpec:
    """The parsed `cache.json`."""

    target: TargetInfo
    layers: LayerInfo
    storage: StorageInfo
    tokenizer: TokenizerInfo
    data: DataInfo
    plan: PlanInfo
    projection: ProjectionInfo | None = None  # None: the tapped layers as they are
    format_version: int = FORMAT_VERSION
    tool_version: str = ""
    created: str = ""
    # how the run that created the cache sharded the target (`extract --tp`; target/parallel.py), for
    # information: a cache extracted at any --tp is the same cache, and each resumes the other
    parallel: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.format_version = PROJECTED_VERSION if self.projection is not None else FORMAT_VERSION

    @property
    def row_width(self) -> int:
        """Values per cached token: K tapped layers times the hidden size, or the projection's rank."""
        if self.projection is not None:
            return self.projection.rank
        return len(self.layers.ids) * self.target.hidden_size

    @property
    def raw_bf16_bytes_per_token(self) -> int:
        """The tapped layers of a token as they are, in bf16: what a projection and fp8 are measured against."""
        return 2 * len(self.layers.ids) * self.target.hidden_size

    @property
    def groups(self) -> list[list[int]]:
        """Positions of the tapped layers in each stored group of values: one group a layer, or
        one for all of them under a joint projection."""
        k = len(self.layers.ids)
        return self.projection.groups(k) if self.projection is not None else [[i] for i in range(k)]

    def group_positions(self, layer_ids: list[int]) -> list[int]:
        """The stored groups a drafter of `layer_ids` reads, in the cache's order (SpecError when
        its layers do not make whole groups)."""
        cached = list(self.layers.ids)
        check_drafter_fits(self, layer_ids=layer_ids)
        positions = [cached.index(i) for i in layer_ids]
        if len(set(positions)) != len(positions) or positions != sorted(positions):
            raise SpecError(f"layers: {layer_ids} must be distinct and in the cache's order {cached}")
        wanted = set(positions)
        groups = [g for g, members in enumerate(self.groups) if wanted & set(members)]
        if any(not set(self.groups[g]) <= wanted for g in groups):
            raise SpecError(f"layers: the cache stores layers {cached} projected together (projection.basis "
                            f"'joint'), so a drafter reads all of them, not {layer_ids}; extract with "
                            "--project-basis per-layer to keep layer subsets possible")  # fmt: skip
        return groups

    def context_width(self, layer_ids: list[int]) -> int:
        """Values per token a drafter of `layer_ids` reads from this cache: its `fc`'s inputs."""
        groups = self.group_positions(layer_ids)
        return self.row_width * len(groups) // len(self.groups)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.projection is None:  # cache.json stays what versions before the option wrote
            del d["projection"]
        if not self.layers.final_hidden:  # cache.json stays what versions before the option wrote
            del d["layers"]["final_hidden"]
        else:
            d["layers"]["final_meaning"] = FINAL_MEANING
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheSpec:
        version = d.get("format_version")
        if version not in VERSIONS:
            raise SpecError(
                f"format_version: cache has {version!r}, this dflash-cache reads {' and '.join(map(str, VERSIONS))}"
                + (" (upgrade dflash-cache)" if isinstance(version, int) and version > max(VERSIONS) else "")
            )
        if (version == PROJECTED_VERSION) != ("projection" in d):
            raise SpecError(f"cache.json is malformed: format_version {version} "
                            f"{'needs' if version == PROJECTED_VERSION else 'has no'} a projection")  # fmt: skip
        try:
            projection = ProjectionInfo(**d["projection"]) if "projection" in d else None
            return cls(
                target=TargetInfo(**d["target"]),
                layers=LayerInfo(**{k: v for k, v in d["layers"].items() if k != "final_meaning"}),
                storage=StorageInfo(**d["storage"]),
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                data=DataInfo(**d["data"]),
                plan=PlanInfo(**d["plan"]),
                projection=projection,
                format_version=version,
                tool_version=d.get("tool_version", ""),
                created=d.get("created", ""),
                parallel=d.get("parallel", {}),
            )
        except (KeyError, TypeError) as e:
            raise SpecError(f"cache.json is malformed: {e}") from None

    def differences(self, other: CacheSpec) -> list[str]:
        """Dotted names of the fields whose values differ, ignoring run-only fields."""

        def plain(spec: CacheSpec) -> dict[str, Any]:  # as it reads back from cache.json, every field present
            return json.loads(json.dumps(dataclasses.asdict(spec)))

        return _diff(plain(self), plain(other), "")


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if (not prefix and key in _VOLATILE) or f"{prefix}{key}" in _EXPLANATIONS:
                continue
            out += _diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} vs {b!r})"]


def read_spec(cache_dir: str | Path) -> CacheSpec:
    """Load and validate `cache.json`, with an error that says what is wrong."""
    path = Path(cache_dir) / CACHE_JSON
    if Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise SpecError(f"{cache_dir} is a file, not a dflash cache (a directory holding {CACHE_JSON})")
    if not path.is_file():
        raise SpecError(f"{cache_dir} is not a dflash cache (no {CACHE_JSON})")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"{path} is unreadable or not JSON: {e}") from None
    if not isinstance(d, dict):
        raise SpecError(f"{path} is not a JSON object")
    return CacheSpec.from_dict(d)


def write_spec(cache_dir: str | Path, spec: CacheSpec) -> None:
    """Write `cache.json` atomically (temp file + rename), once."""
    write_atomic(Path(cache_dir) / CACHE_JSON, json.dumps(spec.to_dict(), indent=2) + "\n")


def check_drafter_fits(
    spec: CacheSpec,
    *,
    layer_ids: list[int],
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    mask_token_id: int | None = None,
    tokenizer_digest: str | None = None,
    final_hidden: bool = False,
) -> None:
    """Refuse a drafter that does not fit the cache, naming the field that does not."""
    missing = [i for i in layer_ids if i not in spec.layers.ids]
    if missing:
        raise SpecError(f"layers: drafter wants {missing}, cache holds only {spec.layers.ids}")
    if final_hidden and not spec.layers.final_hidden:
        raise SpecError("layers.final_hidden: the drafter trains on the target's final hidden state, which the "
                        "cache does not hold; extract it with `dflash extract --final-hidden`")
    if hidden_size is not None and hidden_size != spec.target.hidden_size:
        raise SpecError(f"hidden_size: drafter {hidden_size} != cache target {spec.target.hidden_size}")
    if vocab_size is not None and vocab_size != spec.target.vocab_size:
        raise SpecError(f"vocab_size: drafter {vocab_size} != cache target {spec.target.vocab_size}")
    if mask_token_id is not None and not 0 <= mask_token_id < spec.target.vocab_size:
        raise SpecError(f"mask_token_id: {mask_token_id} is outside the vocabulary of {spec.target.vocab_size}")
    if tokenizer_digest is not None and tokenizer_digest != spec.tokenizer.digest:
        raise SpecError(f"tokenizer: digest {tokenizer_digest} != cache {spec.tokenizer.digest}")
