"""orbax_mtc.CheckpointManager in one process (no jax.distributed) on a 2x2 CPU mesh."""

from __future__ import annotations

import contextlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, assert_host_equal, assert_trees_equal, make_state
from manager_support import (
  _composite,
  _flip_first_shard,
  _links,
  _options,
  _persistent_steps,
  _save_range,
)

import orbax_mtc as mtc
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local.format import MANIFEST
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps

pytestmark = pytest.mark.timeout(120)


def test_is_an_orbax_checkpoint_manager(open_manager, dirs):
  mgr = open_manager()
  assert isinstance(mgr, ocp.CheckpointManager)
  assert mgr.local_directory == dirs[0]
  assert str(mgr.directory) == str(dirs[1])
  assert dirs[0].is_dir() and dirs[1].is_dir()
  assert mgr.all_steps() == [] and mgr.latest_step() is None
  assert mgr.restore(None) is None
  assert mgr.last_restore.tier == "none" and mgr.last_restore.step is None


def test_context_manager_closes(dirs, mesh):
  with mtc.CheckpointManager(dirs[0], dirs[1], mesh, abstract_of(make_state(mesh)),
                             options=_options()) as mgr:
    assert mgr.save(0, args=_composite(make_state(mesh, 0)))
  assert committed_steps(dirs[0]) == [0]


def test_round_trip_composite(open_manager, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 9))
  restored = mgr.restore(None)
  assert isinstance(restored, ocp.args.Composite)
  assert mgr.last_restore.step == 8 and mgr.last_restore.tier == "local"
  assert_trees_equal(restored.state, states[8])
  assert_trees_equal(restored["state"], states[8])
  explicit = mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_of(states[8]))))
  assert_trees_equal(explicit.state, states[8])
  # An older step still held locally.
  older = mgr.restore(6)
  assert mgr.last_restore.step == 6 and mgr.last_restore.tier == "local"
  assert_trees_equal(older.state, states[6])


@pytest.mark.parametrize("save_cls", [ocp.args.PyTreeSave, ocp.args.StandardSave])
def test_round_trip_single_item(open_manager, mesh, save_cls):
  mgr = open_manager()
  state = make_state(mesh, 2)
  assert mgr.save(2, args=save_cls(state))
  mgr.wait_until_finished()
  restored = mgr.restore(None)
  assert mgr.last_restore.tier == "local" and mgr.last_restore.step == 2
  assert_trees_equal(restored, state)  # the bare tree, as plain Orbax returns it
  explicit = mgr.restore(2, args=ocp.args.PyTreeRestore(item=abstract_of(state)))
  assert_trees_equal(explicit, state)


def test_synchronous_mode(open_manager, mesh):
  mgr = open_manager(_options(enable_async_checkpointing=False))
  states, _ = _save_range(mgr, mesh, range(0, 5))
  assert committed_steps(mgr.local_directory) == [2, 4]
  assert_trees_equal(mgr.restore(None).state, states[4])


def test_json_item_round_trip(open_manager, dirs, mesh):
  mgr = open_manager()
  state = make_state(mesh, 4)
  args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                            meta=ocp.args.JsonSave({"lr": 0.5, "tags": ["a"]}))
  assert mgr.save(4, args=args)
  mgr.wait_until_finished()
  restore_args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract_of(state)),
                                    meta=ocp.args.JsonRestore())
  restored = mgr.restore(4, args=restore_args)
  assert mgr.last_restore.tier == "local"
  assert restored.meta == {"lr": 0.5, "tags": ["a"]}
  assert_trees_equal(restored.state, state)
  mgr.close()
  shutil.rmtree(dirs[0])
  again = open_manager()
  restored = again.restore(4, args=restore_args)
  assert again.last_restore.tier == "persistent"
  assert restored.meta == {"lr": 0.5, "tags": ["a"]}
  assert_trees_equal(restored.state, state)


def test_saving_schedule(open_manager, dirs, mesh):
  # Synchronous, so that every scheduled backup lands before the next one is due (in async
  # mode a backup still waiting for a busy store is replaced by a newer one).
  mgr = open_manager(_options(enable_async_checkpointing=False))
  expected = {0: True, 1: False, 2: True, 3: False, 4: True, 5: False, 6: True, 7: False,
              8: True}
  assert mgr.should_save(0)
  _, results = _save_range(mgr, mesh, range(0, 9))
  assert results == expected
  assert {s: mgr.should_save(s) for s in (8, 9, 10, 12)} == \
      {8: False, 9: False, 10: True, 12: True}
  assert committed_steps(dirs[0]) == [6, 8]
  assert _persistent_steps(dirs[1]) == [0, 4, 8]
  assert mgr.all_steps() == [0, 4, 6, 8]
  assert mgr.latest_step() == 8


def test_force_saves_off_schedule(open_manager, dirs, mesh):
  mgr = open_manager()
  # Like plain Orbax, the very first save of a fresh run is always taken (InitialSavePolicy).
  assert mgr.save(1, args=_composite(make_state(mesh, 1))) is True
  state = make_state(mesh, 3)
  assert mgr.should_save(3) is False
  assert mgr.save(3, args=_composite(state)) is False
  assert mgr.save(3, args=_composite(state), force=True) is True
  mgr.wait_until_finished()
  # Step 1 was off the local schedule, but a backup is taken from the RAM tier.
  assert committed_steps(dirs[0]) == [1, 3]
  assert _persistent_steps(dirs[1]) == [1, 3]
  assert_trees_equal(mgr.restore(3).state, state)


def test_save_rejects_bad_step_and_args(open_manager, mesh):
  mgr = open_manager()
  with pytest.raises(ValueError, match="step"):
    mgr.save(-2, args=_composite(make_state(mesh)))
  with pytest.raises(TypeError, match="Composite"):
    mgr.save(2, args=ocp.args.JsonSave({"a": 1}))
  assert mgr.all_steps() == []


def test_retention_and_lkg(open_manager, dirs, mesh):
  mgr = open_manager(_options(local_keep=2, persistent_keep=2))
  for last in range(0, 13, 2):
    mgr.save(last, args=_composite(make_state(mesh, last)))
    mgr.wait_until_finished()
    committed = committed_steps(dirs[0])
    assert committed == list(range(0, last + 1, 2))[-2:]
    # Never more than one spare, never a leftover temporary folder.
    names = [p.name for p in dirs[0].iterdir()]
    assert len([n for n in names if n.startswith(".spare-")]) <= 1
    assert not [n for n in names if n.startswith(".tmp-")]
    assert _links(dirs[0]) == {lkg.link_name("orbax", last, 0, 0): lkg.link_target(last)}
    assert ((dirs[0] / lkg.link_name("orbax", last, 0, 0)).resolve()
            == dirs[0] / str(last) / MANIFEST)
  assert _persistent_steps(dirs[1]) == [8, 12]
  assert mgr.all_steps() == [8, 10, 12]


def test_retention_keeps_only_newest_with_max_to_keep_1(open_manager, dirs, mesh):
  mgr = open_manager(_options(local_every=1, persistent_every=1000, local_keep=1))
  states, _ = _save_range(mgr, mesh, range(1, 6))
  assert committed_steps(dirs[0]) == [5]
  assert_trees_equal(mgr.restore(None).state, states[5])


def test_reached_preemption_is_stable(open_manager):
  mgr = open_manager()
  assert mgr.reached_preemption(3) is False
  assert mgr.reached_preemption(3) is False


def test_force_save_of_existing_local_step(open_manager, dirs, mesh):
  """Saving a step that is already committed locally must not fail later with a misleading
  "failed: None ... RAM disk is full" OSError; the committed bytes stay as they were.

  Plain Orbax raises StepAlreadyExistsError from save() itself; either that or a successful
  save is acceptable.
  """
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, [0, 2])
  assert _persistent_steps(dirs[1]) == [0] and committed_steps(dirs[0]) == [0, 2]
  with contextlib.suppress(ocp.checkpoint_manager.StepAlreadyExistsError):
    mgr.save(2, args=_composite(make_state(mesh, 99)), force=True)
  mgr.wait_until_finished()
  assert_trees_equal(mgr.restore(2).state, states[2])
  mgr.close()
  # The tiers never disagree about what step 2 holds.
  if 2 in _persistent_steps(dirs[1]):
    shutil.rmtree(dirs[0])
    again = open_manager()
    assert_trees_equal(again.restore(2).state, states[2])
    assert again.last_restore.tier == "persistent"


def test_restart_restores_newest_local_step(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  mgr.close()
  again = open_manager()
  restored = again.restore(None)
  assert again.last_restore.tier == "local" and again.last_restore.step == 6
  assert_trees_equal(restored.state, states[6])


@pytest.mark.parametrize("shape,devices", [((4, 1), 4), ((1, 2), 2)],
                         ids=["mesh-4x1", "two-devices"])
def test_restart_on_another_mesh_rebuilds_the_ram_step(open_manager, dirs, mesh, shape, devices):
  """Saved on a (data=2, model=2) mesh; restored on another mesh, or on half the devices: the
  newest RAM step (not in the persistent tier) is rebuilt from RAM, bit for bit, and written
  back in the new layout, where the next restart finds it as an ordinary RAM step."""
  mgr = open_manager()
  _save_range(mgr, mesh, range(0, 7))
  mgr.close()
  other = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:devices])
  want = make_state(other, 6)
  for tier in ("elastic", "local"):
    with mtc.CheckpointManager(dirs[0], dirs[1], other, abstract_of(want),
                               options=_options()) as again:
      assert again.latest_step() == 6
      restored = again.restore(None)
      assert (again.last_restore.step, again.last_restore.tier) == (6, tier)
      assert_trees_equal(restored.state, want)


@pytest.mark.parametrize("single", [False, True], ids=["composite", "single"])
def test_restart_without_local_restores_persistent(open_manager, dirs, mesh, single):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7), single=single)
  mgr.close()
  shutil.rmtree(dirs[0])
  again = open_manager()
  assert again.all_steps() == [0, 4]
  restored = again.restore(None)
  assert again.last_restore.tier == "persistent" and again.last_restore.step == 4
  assert_trees_equal(restored if single else restored.state, states[4])
  if single:
    explicit = again.restore(None, args=ocp.args.PyTreeRestore(item=abstract_of(states[4])))
    assert_trees_equal(explicit, states[4])
  else:
    explicit = again.restore(None, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract_of(states[4]))))
    assert_trees_equal(explicit.state, states[4])
  # Training goes on from the restored step: the next local save works.
  again.save(6, args=_composite(make_state(mesh, 60)))
  again.wait_until_finished()
  assert committed_steps(dirs[0]) == [6]


def test_nothing_anywhere_restores_none(open_manager, dirs):
  mgr = open_manager()
  assert mgr.restore(None) is None
  assert mgr.last_restore.tier == "none"
  with pytest.raises(FileNotFoundError, match="Step 4"):
    mgr.restore(4)


def test_persistent_tier_is_plain_orbax(open_manager, dirs, mesh):
  mgr = open_manager(_options(enable_async_checkpointing=False))  # every backup lands
  states, _ = _save_range(mgr, mesh, range(0, 9))
  mgr.close()
  plain = ocp.CheckpointManager(dirs[1])
  try:
    assert plain.all_steps() == [0, 4, 8]
    for step in (4, 8):
      host = jax.tree.map(np.asarray, states[step])
      restore_args = ocp.checkpoint_utils.construct_restore_args(host)
      out = plain.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(restore_args=restore_args)))
      assert_host_equal(out.state, host)
    # With sharded targets it gives back the same jax arrays too.
    abstract = abstract_of(states[8])
    out = plain.restore(8, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
    assert_trees_equal(out.state, states[8])
  finally:
    plain.close()


def test_persistent_single_item_is_plain_orbax(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, [4], single=True)
  mgr.close()
  with ocp.CheckpointManager(dirs[1]) as plain:
    host = jax.tree.map(np.asarray, states[4])
    out = plain.restore(4, args=ocp.args.PyTreeRestore(
        restore_args=ocp.checkpoint_utils.construct_restore_args(host)))
    assert_host_equal(out, host)


def test_corrupt_newest_local_step_falls_back_to_older_local(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  assert committed_steps(dirs[0]) == [4, 6]
  _flip_first_shard(dirs[0] / "6")
  with pytest.raises(mtc.CorruptStepError, match="checksum"):
    verify_step(dirs[0] / "6")
  verify_step(dirs[0] / "4")
  restored = mgr.restore(None)
  assert mgr.last_restore.step == 4 and mgr.last_restore.tier == "local"
  assert_trees_equal(restored.state, states[4])


def test_corrupt_local_steps_fall_back_to_persistent(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  for step in (4, 6):
    _flip_first_shard(dirs[0] / str(step))
  restored = mgr.restore(None)
  assert mgr.last_restore.step == 4 and mgr.last_restore.tier == "persistent"
  assert_trees_equal(restored.state, states[4])


def test_leftover_tmp_folder_is_never_restored(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  # A complete-looking copy of a newer step that never got its commit rename.
  shutil.copytree(dirs[0] / "6", dirs[0] / ".tmp-8-deadbeef")
  assert mgr.latest_step() == 6
  restored = mgr.restore(None)
  assert mgr.last_restore.step == 6
  assert_trees_equal(restored.state, states[6])
  mgr.close()
  # A new manager clears interrupted saves at start.
  again = open_manager()
  assert not (dirs[0] / ".tmp-8-deadbeef").exists()
  assert again.all_steps() == [0, 4, 6]
