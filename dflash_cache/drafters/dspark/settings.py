"""DSpark's settings: the backbone's (`drafters/settings.py`), and its heads' and loss weights. Light:
importing it loads no torch (the CLI offers them as `dflash train` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from dflash_cache.core.settings import setting
from dflash_cache.drafters.settings import DrafterSettings

MarkovHead = Literal["vanilla", "gated", "rnn"]
HEAD_TYPES: tuple[str, ...] = get_args(MarkovHead)


@dataclass
class DSparkSettings(DrafterSettings):
    """The backbone's settings and DSpark's own: its heads and its loss weights."""

    markov_rank: int = setting(256, "dspark: rank of the Markov head, which conditions each slot's logits on the "
                               "previous token (0: no Markov head).", min=0)  # fmt: skip
    markov_head: MarkovHead = setting("vanilla", "dspark: the Markov head's type.")
    confidence_with_markov: bool = setting(True, "dspark: the confidence head also reads the previous token's "
                                           "Markov embedding.")  # fmt: skip
    ce_alpha: float = setting(0.1, "dspark: weight of the cross-entropy term.", min=0, tuning=True)
    l1_alpha: float = setting(0.9, "dspark: weight of the L1 (total-variation) term against the target's own "
                              "distribution.", min=0, tuning=True)  # fmt: skip
    confidence_alpha: float = setting(1.0, "dspark: weight of the confidence head's BCE term (0: no confidence "
                                      "head).", min=0, tuning=True)  # fmt: skip


SETTINGS = DSparkSettings
