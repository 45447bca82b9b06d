"""LocalCheckpointOptions.save_overhead_budget with Orbax's ContinuousCheckpointingPolicy, on a
real manager in one process: a RAM save counts as in progress until the time `save()` calls
took since it began fits the budget. The manager's clock is a fake one that the test moves
(each reading advances it by one tick, as if the call took time), so the counts are exact."""

from __future__ import annotations

import pytest
from conftest import make_state
from manager_support import _composite
from orbax.checkpoint import checkpoint_managers as policies

import orbax_mtc as mtc
from orbax_mtc.forms import multi_tier

pytestmark = pytest.mark.timeout(120)


class _Clock:
  """`time.monotonic` for the manager: each reading is `tick` later than the one before."""

  def __init__(self, tick: float):
    self.now, self.tick = 1000.0, tick

  def monotonic(self) -> float:
    self.now += self.tick
    return self.now


def _options(budget):
  return mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(
          save_decision_policy=policies.ContinuousCheckpointingPolicy(), max_to_keep=1,
          save_overhead_budget=budget),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6),
      replication=mtc.ReplicationOptions(replica_axis="data"))


def _saved_steps(open_manager, mesh, monkeypatch, tmp_path, *, budget, idle, steps=12):
  clock = _Clock(tick=1.0)  # a save() call reads the clock 3 times: it "takes" 2 s
  monkeypatch.setattr(multi_tier, "time", clock)
  run = tmp_path / f"budget-{budget}-idle-{idle}"
  mgr = open_manager(options=_options(budget), local=run / "local",
                     persistent=run / "persistent")
  state = make_state(mesh, 0)
  saved = []
  for step in range(1, steps + 1):
    clock.now += idle  # the training step
    if mgr.save(step, args=_composite(state)):
      saved.append(step)
    mgr.wait_until_finished()  # no write in flight: only the budget holds a save back
  return saved


def test_without_a_budget_continuous_saves_whenever_nothing_is_written(
    open_manager, mesh, monkeypatch, tmp_path):
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=None,
                      idle=1.0) == list(range(1, 13))


def test_a_budget_spaces_the_saves_by_the_time_save_took(open_manager, mesh, monkeypatch,
                                                         tmp_path):
  # Each call takes 2 s and a training step 8 s. The saving call began at t and ended at
  # t + 2; the next call decides at t + 12 (2 s of 12 s: over 10 %), the one after at
  # t + 23 (2 s of 23 s: within): a save every other step. One process has no copies to
  # move, so the calls between saves count for nothing.
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.1,
                      idle=8.0) == [1, 3, 5, 7, 9, 11]
  # 4 s of training a step, 7 s a call: at the fourth call after a save 2 s of 29 s
  # (6.9 %), at the fifth 2 s of 36 s (5.6 %, within 6 %).
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.06,
                      idle=4.0) == [1, 6, 11]
  # Where the loop spends 10x longer training than saving, every step saves.
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.1,
                      idle=100.0) == list(range(1, 13))
