"""Checkpoints: the checkpointer's cadence, retention and restore into the components that own the
state; and a resumed run's retention setting and the line that says where it resumed."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import RecordingSink

from dflash_cache.train.checkpoint import Checkpointer, CpuRng
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.stage import run


class Counter:
    """A component with a small state kept at a checkpoint's top level (as the loader's position)."""

    def __init__(self, key: str, value: int = 0):
        self.key, self.value = key, value

    def state_dict(self) -> dict:
        return {self.key: self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state[self.key]


def test_saves_on_cadence_keeps_the_newest_and_restores_each_component(tmp_path):
    model = torch.nn.Linear(3, 2)
    position, schedule = Counter("batch"), Counter("tokens")
    ckpt = Checkpointer(tmp_path, keep=2, every=3, states={"model": model, "rng": CpuRng()}, top=(position, schedule))
    saved = {}
    for step in range(1, 11):
        position.value, schedule.value = step * 10, step * 100
        with torch.no_grad():
            model.weight.add_(1.0)
        if (path := ckpt.maybe_save(step)) is not None:
            saved[step] = (path, model.weight.clone(), torch.get_rng_state())
        torch.rand(5)  # moves the generator on between saves
    assert sorted(saved) == [3, 6, 9]
    files = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert files == ["step_00000006.pt", "step_00000009.pt"] and ckpt.latest() == saved[9][0]
    state = ckpt.load()  # the file's layout: components by name, counters at the top level
    assert state["batch"] == 90 and state["tokens"] == 900 and set(state) == {"model", "rng", "batch", "tokens"}

    fresh_model, fresh_position, fresh_schedule = torch.nn.Linear(3, 2), Counter("batch"), Counter("tokens")
    again = Checkpointer(tmp_path, states={"model": fresh_model, "rng": CpuRng()}, top=(fresh_position, fresh_schedule))
    assert again.restore()["tokens"] == 900
    assert (fresh_position.value, fresh_schedule.value) == (90, 900)
    assert torch.equal(fresh_model.weight, saved[9][1]) and torch.equal(torch.get_rng_state(), saved[9][2])
    assert Checkpointer(tmp_path / "none").restore() is None
    one = Checkpointer(tmp_path, keep=1, top=(position,))
    one.save(12)  # an explicit save (the run's last) keeps only the newest with keep=1
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")) == ["step_00000012.pt"]


def test_a_resumed_run_says_where_it_resumed_and_keeps_as_told(tiny_cache, tmp_path):
    out = tmp_path / "run"

    def cfg(max_steps: int) -> TrainConfig:
        return TrainConfig(cache=tiny_cache, out=out, epochs=1, max_steps=max_steps, token_budget=1024,
                           max_anchors=8, draft_layers=1, save_every=1, log_every=1, keep_checkpoints=1)  # fmt: skip

    first = RecordingSink()
    run(cfg(2), first)
    # a fresh run resumes nothing, and says how its drafter attends
    assert [d["info"] for d in first.deltas if "info" in d] == [
        "drafter: dflash, 1 layer, every layer slides in a window of 2,048 tokens (--sliding-window full for none)"]
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*.pt")) == ["step_00000002.pt"]  # keep 1
    second = RecordingSink()
    run(cfg(3), second)
    notes = [d["info"] for d in second.deltas if "info" in d]
    assert notes == [f"resumed at epoch 1, batch 2 (step 2) from {Path(checkpoints / 'step_00000002.pt')}"]
    assert sorted(p.name for p in checkpoints.glob("step_*.pt")) == ["step_00000003.pt"]
