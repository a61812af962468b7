"""The DFlash drafter's config: its geometry (the target's), the target facts it depends on, and
the serving config.json that z-lab's DFlashDraftModel, vLLM and SGLang read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_cache.cache.spec import default_layer_ids
from dflash_cache.drafters.serving import geometry, rope_from, target_text_config

INITIALIZER_RANGE = 0.02  # Qwen3's initializer_range: std of the Linear weights at init
# The remote-code modeling file every export carries, under the name z-lab's drafters use, so that
# AutoModel.from_pretrained(export, trust_remote_code=True) loads it (config.json's auto_map).
MODELING_SOURCE = Path(__file__).with_name("modeling_dflash.py")
MODELING_FILE = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
ARCHITECTURE = "DFlashDraftModel"
BLOCK_SIZE = 16  # the DFlash paper's
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types, which z-lab's reference reads
LAYER_TYPES = (SLIDING, FULL)


@dataclass
class DrafterConfig:
    """Geometry of a DFlash drafter and the target facts it depends on."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    rope_scaling: dict | None = None
    num_hidden_layers: int = 5  # draft layers
    block_size: int = BLOCK_SIZE
    attention_bias: bool = False
    hidden_act: str = "silu"
    # fc's inputs in training on a projected cache (the projected values of the tapped layers); None:
    # the K tapped layers side by side. The export folds the projection back (fc = fc' W), so a
    # serving config never has it.
    context_width: int | None = None
    # Sliding-window draft layers (`drafters.attention`'s rule): W, and each layer's type,
    # "sliding_attention" or "full_attention". None, None: full attention everywhere.
    sliding_window: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be non-empty and distinct, got {ids}")
        if min(ids) < 0 or max(ids) >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} out of range for {self.num_target_layers} target layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.rope_scaling is not None:
            self.rope_theta, self.rope_scaling = rope_from(
                {"rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}
            )
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        """Layer types one a draft layer, of the two kinds; a window where a layer slides. Full
        attention everywhere is kept as (None, None), what a config without a window says."""
        types = self.layer_types
        if types is not None:
            types = self.layer_types = [str(t) for t in types]
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(types)} entries for {self.num_hidden_layers} draft layers")
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types: unknown {', '.join(unknown)} (expected {' or '.join(LAYER_TYPES)})")
        if types is None or SLIDING not in types:
            self.layer_types = self.sliding_window = None
            return
        if self.sliding_window is None or int(self.sliding_window) < 1:
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window!r}")
        self.sliding_window = int(self.sliding_window)

    @property
    def windows(self) -> list[int | None]:
        """Each draft layer's window: W for a sliding layer, None for a full one."""
        types = self.layer_types or [FULL] * self.num_hidden_layers
        return [self.sliding_window if t == SLIDING else None for t in types]

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_inputs(self) -> int:
        """Values per context token that `fc` reads: the projected ones, or the K tapped layers'."""
        return self.context_width or self.num_context_layers * self.hidden_size

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        target_layer_ids: list[int] | None,
        mask_token_id: int,
        num_draft_layers: int = 5,
        block_size: int = BLOCK_SIZE,
        sliding_window: int | None = None,
        layer_types: list[str] | None = None,
    ) -> DrafterConfig:
        """Drafter geometry from a HF target config.json dict (Qwen3/Llama-like keys; a
        multimodal config's text_config is used when the top level has no hidden_size).
        target_layer_ids None means the default 5 spread layers; sliding_window and layer_types
        the draft layers' windows (None: full attention everywhere)."""
        t = target_text_config(target_config)
        n_target = t["num_hidden_layers"]
        return cls(
            **geometry(t),
            target_layer_ids=(default_layer_ids(n_target) if target_layer_ids is None else list(target_layer_ids)),
            num_target_layers=n_target,
            mask_token_id=mask_token_id,
            num_hidden_layers=num_draft_layers,
            block_size=block_size,
            sliding_window=sliding_window,
            layer_types=layer_types,
        )

    def rope_parameters(self) -> dict:
        """RoPE in transformers 5's spelling (`rope_parameters`)."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def to_serving_config(self) -> dict:
        """The config.json that z-lab's DFlashDraftModel, vLLM and SGLang read."""
        if self.context_width is not None:
            raise ValueError("a drafter trained on projected features is served folded: export it through "
                             "dflash_cache.train.fold")  # fmt: skip
        n = self.num_hidden_layers
        return {
            "architectures": [ARCHITECTURE],
            "auto_map": dict(AUTO_MAP),
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": INITIALIZER_RANGE,
            "intermediate_size": self.intermediate_size,
            "layer_types": self.layer_types or [FULL] * n,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.layer_types.index(SLIDING) if self.layer_types else n,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": n,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 4 / vLLM read rope_theta + rope_scaling, 5 reads
            # rope_parameters; they agree.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": self.rope_parameters(),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            # a sliding layer's block stays bidirectional, as trained: z-lab's reference makes
            # sliding layers causal unless the config says otherwise
            **({"is_causal": False} if self.sliding_window is not None else {}),
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_serving_config(cls, d: dict) -> DrafterConfig:
        dflash = d.get("dflash_config") or {}
        return cls(
            **geometry(d),
            attention_bias=d.get("attention_bias", False),
            target_layer_ids=dflash["target_layer_ids"],
            num_target_layers=d["num_target_layers"],
            mask_token_id=dflash["mask_token_id"],
            num_hidden_layers=d["num_hidden_layers"],
            block_size=d.get("block_size", dflash.get("block_size", BLOCK_SIZE)),
            **sliding_from(d),
        )


def sliding_from(d: dict) -> dict:
    """(sliding_window, layer_types) of a serving config.json as transformers' Qwen3Config reads
    them: the window only with use_sliding_window, the layer types given or else those at and past
    max_window_layers sliding. A sliding layer that z-lab's reference would run causally within
    the block (is_causal unset or true) is refused: this drafter's blocks are bidirectional."""
    n = d["num_hidden_layers"]
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    types = d.get("layer_types") or [SLIDING if window is not None and i >= d.get("max_window_layers", n) else FULL
                                     for i in range(n)]  # fmt: skip
    if SLIDING in types:
        if window is None:
            raise ValueError("config.json: sliding_attention layers without a sliding_window (and use_sliding_window)")
        if d.get("is_causal", True) is not False:
            raise ValueError("config.json: sliding_attention layers that are causal within the block (is_causal is "
                             "not false) are not supported; their blocks are bidirectional only with is_causal: false")
    return {"sliding_window": window, "layer_types": list(types)}
