"""LocalCheckpointOptions.save_overhead_budget with Orbax's ContinuousCheckpointingPolicy, on a
real manager in one process: after each RAM save the policy is not asked again until the
previous cycle's cost fits the budget's share of the calls since. The manager's clock is a
fake one that the test moves (each reading advances it by one tick, as if the call took
time), so the counts are exact."""

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


def _saved_steps(open_manager, mesh, monkeypatch, tmp_path, *, budget, idle, steps=12,
                 slowed=0.0):
  """The steps saved; `slowed`: how much longer the step right after a save takes (as
  beside the save's background work)."""
  clock = _Clock(tick=1.0)  # a save() call reads the clock at its start and end: 1 s
  monkeypatch.setattr(multi_tier, "time", clock)
  run = tmp_path / f"budget-{budget}-idle-{idle}-slowed-{slowed}"
  mgr = open_manager(options=_options(budget), local=run / "local",
                     persistent=run / "persistent")
  state = make_state(mesh, 0)
  saved = []
  for step in range(1, steps + 1):
    clock.now += idle + (slowed if saved and saved[-1] == step - 1 else 0.0)  # the step
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
  # Each call takes 1 s and a training step 8 s: 10 s from call to call. The first two
  # saves have no cycle before them to measure; after that a cycle's 1 s at 5 % needs 20 s
  # of calls: two calls, a save every other step. One process has no copies to move, so
  # the calls between saves cost the budget nothing.
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.05,
                      idle=8.0) == [1, 2, 4, 6, 8, 10, 12]
  # 6 s a call, 3 %: 1 s needs 33.3 s of calls, 6 calls.
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.03,
                      idle=4.0) == [1, 2, 8]
  # Where the loop spends 100x longer training than saving, every step saves.
  assert _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.1,
                      idle=100.0) == list(range(1, 13))


def test_a_budget_counts_the_steps_a_save_slows_too(open_manager, mesh, monkeypatch, tmp_path):
  # 4 s steps, 1 s calls, 3 %: a save's 1 s inside save() holds the RAM policy 6 calls. When
  # the step right after each save takes 3 s longer (the writer and the copies beside it),
  # the cycle costs 1 + 3 s (the slowed step against the median step), and the hold after
  # it grows to 20 calls. (The first two cycles have no step median to compare with.)
  quiet = _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.03, idle=4.0,
                       steps=40)
  assert quiet == [1, 2, 8, 14, 20, 26, 32, 38]
  slowed = _saved_steps(open_manager, mesh, monkeypatch, tmp_path, budget=0.03, idle=4.0,
                        steps=40, slowed=3.0)
  assert slowed == [1, 2, 6, 26]
