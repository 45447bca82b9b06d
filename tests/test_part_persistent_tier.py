"""PersistentTier and AgreedPreemptionManager (orbax_mtc/persistent/tier.py) on their own: a
real Orbax CheckpointManager on a temporary folder, one process, small states; the agreement
`delete` makes is a fake that records what this process says and answers a scripted list of
records (one per process)."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, assert_trees_equal, make_state
from orbax.checkpoint import checkpoint_managers as policies

import orbax_mtc
from orbax_mtc import agreement, summary
from orbax_mtc.persistent.tier import AgreedPreemptionManager, PersistentTier

_STATE = {"w": np.arange(6, dtype=np.float32), "n": np.int32(3)}


def _args(state=_STATE):
  return ocp.args.Composite(state=ocp.args.PyTreeSave(state))


def _tier(path, *, agreed_preemption: bool = True, **options) -> PersistentTier:
  cls = AgreedPreemptionManager if agreed_preemption else ocp.CheckpointManager
  return PersistentTier(cls(path, options=ocp.CheckpointManagerOptions(**options)))


@pytest.fixture
def tiers():
  """Builds tiers and closes them at teardown."""
  made: list[PersistentTier] = []

  def build(path, **kwargs) -> PersistentTier:
    made.append(_tier(path, **kwargs))
    return made[-1]

  yield build
  for tier in made:
    tier.close()


class _Agree:
  """The fake agreement: this process's record first, then the scripted others'."""

  def __init__(self, *others):
    self.others, self.calls = list(others), []

  def __call__(self, record, what):
    self.calls.append((record, what))
    return summary.simulate([record, *self.others])


def _saved(tier: PersistentTier, *steps: int) -> PersistentTier:
  for step in steps:
    tier.save(step, _args(), None, None)
  tier.wait()
  return tier


def test_save_is_forced_and_wait_leaves_nothing_running(tmp_path, tiers):
  tier = tiers(tmp_path / "p", save_interval_steps=5)
  assert tier.steps() == [] and tier.directory == tmp_path / "p"
  _saved(tier, 0)
  assert not tier.orbax.should_save(3)  # Orbax's own schedule would skip it
  tier.save(3, _args(), {"loss": 1.0}, {"note": "backup"})
  tier.wait()
  assert tier.steps() == [0, 3]
  assert not tier.busy() and not tier.finalizing()
  assert tier.leftover_errors() == []
  assert tier.metadata(3).custom_metadata == {"note": "backup"}
  assert tier.step_directory(3) == tmp_path / "p" / "3"
  assert (tier.step_directory(3) / "state").is_dir()
  assert tier.orbax_options.save_interval_steps == 5


def test_commit_time_is_orbax_commit_timestamp(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 1, 2)
  first, second = tier.commit_time(1), tier.commit_time(2)
  assert isinstance(first, float) and first > 0
  assert first <= second
  assert second == tier.metadata(2).commit_timestamp_nsecs / 1e9


def test_restore_round_trips_a_numpy_state(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 0)
  restored = tier.restore(0, ocp.args.Composite(state=ocp.args.PyTreeRestore()))
  np.testing.assert_array_equal(restored.state["w"], _STATE["w"])
  assert int(restored.state["n"]) == 3


def test_restore_round_trips_a_sharded_jax_state(tmp_path, tiers, mesh):
  state = make_state(mesh, seed=3)
  tier = tiers(tmp_path / "p")
  tier.save(7, _args(state), None, None)
  tier.wait()
  target = abstract_of(state)
  restored = tier.restore(7, ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))))
  assert_trees_equal(restored.state, state)


def test_delete_when_every_process_sees_the_step(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 1, 2)
  agree = _Agree(agreement.OutcomeRecord())  # two processes
  tier.delete(1, agree)
  assert agree.calls == [(agreement.OutcomeRecord(), "delete(1)")]
  assert tier.steps() == [2] and not (tmp_path / "p" / "1").exists()


def test_delete_refused_when_another_process_does_not_see_the_step(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 1, 2)
  agree = _Agree(agreement.OutcomeRecord(
      fault=agreement.Fault("FileNotFoundError", "not in its view")))
  with pytest.raises(orbax_mtc.CheckpointError, match=r"delete\(1\)") as raised:
    tier.delete(1, agree)
  assert raised.value.origins == {1: "FileNotFoundError: not in its view"}
  assert not agree.calls[0][0].fault.present  # this process does see it
  assert tier.steps() == [1, 2] and (tmp_path / "p" / "1").is_dir()


def test_delete_of_a_step_this_process_does_not_see_is_agreed_and_raised(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 1)
  agree = _Agree()
  with pytest.raises(orbax_mtc.CheckpointError) as raised:
    tier.delete(9, agree)
  fault = agree.calls[0][0].fault
  assert fault.kind == "FileNotFoundError"
  assert fault.message.startswith("step 9 is not in its view of ")
  assert list(raised.value.origins) == [0]
  assert tier.steps() == [1] and (tmp_path / "p" / "1").is_dir()


def test_delete_rereads_a_lagging_view_first(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p"), 1)
  other = _saved(tiers(tmp_path / "p"), 4)  # a save this tier's cached list does not know
  assert tier.steps() == [1]
  tier.delete(4, _Agree())
  assert tier.steps() == [1]
  other.reload()
  assert other.steps() == [1]


def test_delete_agrees_a_failure_to_read_the_folder(tmp_path, tiers, monkeypatch):
  tier = _saved(tiers(tmp_path / "p"), 1)

  def broken_reload():
    raise OSError("volume gone")

  monkeypatch.setattr(tier.orbax, "reload", broken_reload)
  agree = _Agree()
  with pytest.raises(orbax_mtc.CheckpointError, match="volume gone"):
    tier.delete(3, agree)
  assert agree.calls[0][0] == agreement.OutcomeRecord(
      fault=agreement.Fault("OSError", "volume gone"))
  assert tier.steps() == [1]


def test_retention_drops_follows_max_to_keep_and_best_n(tmp_path, tiers):
  latest = _saved(tiers(tmp_path / "latest", max_to_keep=1), 0, 1)
  assert latest.steps() == [1]
  assert not latest.retention_drops(2, None)  # LatestN keeps the newest step
  best = tiers(tmp_path / "best", max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
  for step, loss in [(0, 3.0), (1, 1.0), (2, 2.0)]:
    best.save(step, _args(), {"loss": loss}, None)
  best.wait()
  assert best.steps() == [1, 2]
  assert best.retention_drops(3, {"loss": 5.0})  # worse than both kept: removed at once
  assert not best.retention_drops(3, {"loss": 0.5})


def test_tracks_best_and_best_step(tmp_path, tiers):
  best = tiers(tmp_path / "best", best_fn=lambda m: m["loss"], best_mode="min")
  assert best.tracks_best() and best.best_step() is None
  for step, loss in [(0, 3.0), (1, 1.0), (2, 2.0)]:
    best.save(step, _args(), {"loss": loss}, None)
  best.wait()
  assert best.best_step() == 1 and best.metrics(1) == {"loss": 1.0}
  plain = _saved(tiers(tmp_path / "plain"), 0, 5)
  assert not plain.tracks_best() and plain.best_step() == 5  # Orbax: the latest step


def test_policy_says_asks_orbax_with_the_agreed_steps(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p", save_interval_steps=2), 0, 2, 4)

  def says(step, agreed, preempted=False, saving=False):
    return tier.policy_says(step, agreed, preempted=preempted, saving=saving)

  assert not tier.orbax.should_save(4)  # this process's own list already holds 4
  assert says(4, [0, 2])  # the agreed list does not: the interval answers
  assert not says(3, [0, 2])
  assert says(3, [0, 2], preempted=True)  # the agreed preemption answer
  assert says(3, [])  # nothing agreed yet: Orbax's initial save
  assert not says(2, [0, 2]) and not says(1, [0, 2])  # not newer than the agreed newest
  assert not says(4, [0, 2, 4]) and not says(4, [0, 2, 4], preempted=True)
  assert says(6, [0, 2, 4]) and not says(5, [0, 2, 4], saving=True)


def test_policy_says_passes_saving_to_a_continuous_policy(tmp_path, tiers):
  tier = _saved(tiers(tmp_path / "p",
                      save_decision_policy=policies.ContinuousCheckpointingPolicy()), 1)
  assert tier.policy_says(2, [1], preempted=False, saving=False)
  assert not tier.policy_says(2, [1], preempted=False, saving=True)


def test_note_preemption_names_that_step_only(tmp_path, tiers):
  tier = tiers(tmp_path / "p")
  assert isinstance(tier.orbax, AgreedPreemptionManager)
  assert not tier.orbax.reached_preemption(5)
  tier.note_preemption(5)
  assert tier.orbax.reached_preemption(5)
  assert not tier.orbax.reached_preemption(4) and not tier.orbax.reached_preemption(6)
  tier.note_preemption(8)
  assert tier.orbax.reached_preemption(8) and not tier.orbax.reached_preemption(5)


def test_note_preemption_leaves_a_plain_orbax_manager_alone(tmp_path, tiers):
  tier = tiers(tmp_path / "p", agreed_preemption=False)
  tier.note_preemption(5)
  assert not hasattr(tier.orbax, "preemption_step")
  assert not tier.orbax.reached_preemption(5)  # still JAX's sync point's answer


def test_default_item_mode_fixed_once(tmp_path, tiers):
  composite = _saved(tiers(tmp_path / "composite"))
  assert composite.default_item_mode() is None
  _saved(composite, 0)
  assert composite.default_item_mode() is False
  single = tiers(tmp_path / "single")
  single.save(0, ocp.args.PyTreeSave(_STATE), None, None)
  single.wait()
  assert single.default_item_mode() is True
  fixed = tiers(tmp_path / "fixed")
  fixed.fix_default_item_mode(True)
  assert fixed.default_item_mode() is True
  fixed.fix_default_item_mode(False)  # set only if unset, as Orbax's own restore does
  assert fixed.default_item_mode() is True
