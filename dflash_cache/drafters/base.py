"""What a drafter family is: the one small interface the trainer, validation, metrics, bench,
export and decoding call (docs/architecture.md, "Drafter families").

A family is a package of this folder whose `family.py` builds one `Family` and whose `settings.py`
names its settings dataclass; `drafters.family(name)` looks it up, and nothing outside the family
branches on its name. The shared pieces a family is built from are modules of this folder: the
block layout and attention rule (`attention.py`), anchors and blocks (`blocks.py`), the chunked
losses (`losses.py`), the serving files (`serving.py`) and the decoding helpers (`decoding.py`).
Light: importing it loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from dflash_cache.drafters.settings import DrafterSettings
from dflash_cache.kernels.tiles import DEFAULT_LOSS_TILES, LossTiles

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from dflash_cache.cache.spec import CacheSpec
    from dflash_cache.drafters.blocks import Blocks

# choose(logits [b, V]) -> (tokens [b], the probabilities they were drawn from [b, V] or None)
Choose = Callable[["Tensor"], "tuple[Tensor, Tensor | None]"]


class TrainingBatch(Protocol):
    """What an objective reads of a packed training batch (the train stage's loader hands these over)."""

    host: tuple[Tensor, Tensor, Tensor]  # CPU copies of (input_ids, loss_mask, offsets [S+1])
    context: Tensor  # [N, K*H] the tapped target layers, on the device
    final: Tensor | None  # [N, H] the target's final hidden state, for a family that asks for it


# objective(model, embed, head, batch, generator) -> Output: a family's objective bound to a run (`Family.bind`)
Objective = Callable[["nn.Module", "Tensor", "Tensor", TrainingBatch, "torch.Generator"], "Output"]


@dataclass
class Output:
    """What a family's objective returns for one batch.

    `loss` is what backward sees. `terms` are the named loss terms as (numerator, denominator)
    sums, detached, so that a window of steps or a validation pass over many batches and ranks
    reduces them exactly (metrics log num/den under the name; DFlash has none beside its loss).
    `correct` [nb, B] says which block slots the argmax predicted right, `blocks` are the batch's
    blocks (their weights say which slots count), and `scored` how many slots reached the LM head
    (the useful-FLOPs count needs it)."""

    loss: Tensor
    correct: Tensor
    blocks: Blocks
    terms: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    scored: Tensor | None = None


@dataclass(frozen=True)
class Family:
    """One drafter family. Every member is a plain function or class of the family's package.

    - `architectures`: the config.json architectures its exports have, and those of checkpoints of
      other tools in the same layout that it loads;
    - `default_block_size`: the block size when the run sets none;
    - `needs_final_hidden`: trains on the target's final hidden state (`extract --final-hidden`);
    - `settings`: its settings dataclass, `DrafterSettings` or an extension of it. Its own fields
      (those beyond `DrafterSettings`) change the model or the loss: a resume must match them;
    - `config(settings, spec)`: the family's config (geometry and heads) from the run's settings and
      the cache's target; ValueError for settings that cannot work (naming the setting), a
      SpecError for a drafter that does not fit the cache;
    - `model(config)`: the draft model. It keeps DFlash's backbone attributes (`fc`, `hidden_norm`,
      `layers`, `norm`, `_rope`) and `forward(block_embeds, context, layout, attention=None)`, which
      returns the final-normed block hidden states;
    - `objective(model, embed, head, batch, config, settings, generator, reduce=False) -> Output`:
      blocks from anchors, the model, the loss; `reduce`: the loss's denominators are summed over
      the data-parallel ranks (training) rather than taken per rank (validation);
    - `flops(model)`: a callable (blocks, context tokens, context keys, scored slots) -> useful
      FLOPs of a training step, forward and backward (MFU), whose `context_keys(layout)` gives the
      third argument of a batch (the sum of its anchors where no layer has a window);
    - `serving_config(config)` / `from_serving_config(dict)`: the export's config.json and back;
    - `save_serving(model, config, out_dir, frozen=None)`: the export (config.json,
      model.safetensors, the family's self-contained remote-code file); `frozen` is the target's
      (embedding, LM head) for families whose serving layout carries them;
    - `load_serving(path, dtype=None, device="cpu") -> (model, config)`;
    - `block_input(anchor_tokens [b], block_size, mask_token_id) -> [b, B]`: the block's input ids;
    - `draft(model, hidden [b, B, H], block_ids [b, B], head_weight [V, H], choose) -> (drafts [b, n],
      probs [b, n, V] or None)`: the proposals for the positions right after the anchor, the i-th
      for anchor + 1 + i; `choose` is called once per drafted position, in order.
    """

    name: str
    architectures: tuple[str, ...]  # the `architectures` of the exports (and foreign checkpoints) it loads
    default_block_size: int
    needs_final_hidden: bool
    settings: type[DrafterSettings]
    config: Callable[[DrafterSettings, CacheSpec], Any]
    model: Callable[[Any], nn.Module]
    objective: Callable[..., Output]
    flops: Callable[[nn.Module], Callable[[int, int, int, int], float]]
    serving_config: Callable[[Any], dict]
    from_serving_config: Callable[[dict], Any]
    save_serving: Callable[..., None]
    load_serving: Callable[..., tuple[nn.Module, Any]]
    block_input: Callable[[Tensor, int, int], Tensor]
    draft: Callable[[nn.Module, Tensor, Tensor, Tensor, Choose], tuple[Tensor, Tensor | None]]

    def bind(self, config: Any, settings: DrafterSettings, *, reduce: bool = False,
             loss_tiles: LossTiles | None = DEFAULT_LOSS_TILES) -> Objective:  # fmt: skip
        """The objective with a run's config and settings bound, as the trainer and validation call it
        for every batch; `reduce` as for `objective`; `loss_tiles` cut the loss kernel's programs
        (None: the loss's PyTorch expression, for a profile against the kernel)."""

        def objective(model: nn.Module, embed: Tensor, head: Tensor, batch: TrainingBatch,
                      generator: torch.Generator) -> Output:  # fmt: skip
            return self.objective(model, embed, head, batch, config, settings, generator, reduce=reduce,
                                  loss_tiles=loss_tiles)  # fmt: skip

        return objective

    def own_settings(self) -> tuple[str, ...]:
        """The names of the settings this family adds to `DrafterSettings`."""
        common = {f.name for f in fields(DrafterSettings)}
        return tuple(f.name for f in fields(self.settings) if f.name not in common)


def batch_final(batch: TrainingBatch) -> Tensor:
    """The batch's final hidden state; the loader hands it over when the family asks for it."""
    if batch.final is None:
        raise ValueError("this drafter family trains on the target's final hidden state: load the batches with "
                         "final_hidden=True from a cache extracted with --final-hidden")  # fmt: skip
    return batch.final
