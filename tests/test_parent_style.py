"""The parent-style constructor: `CheckpointManager(directory, ..., options=ocp options)`.

Without `local_directory` it must behave as `ocp.CheckpointManager` (compared side by side on
the same calls); with one, a RAM tier keeps copies of the parent's steps and restores from them.
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import flip_byte

import orbax_mtc as mtc
from orbax_mtc.forms import arguments as constructor
from orbax_mtc.local.format import DATA, MANIFEST
from orbax_mtc.testing import abstract_of, assert_trees_equal, example_state

pytestmark = pytest.mark.timeout(120)


def _array_state(mesh, seed):
  """The example state without its host leaves: every leaf a sharded jax.Array."""
  return example_state(mesh, seed, arrays_only=True)


def _ram_steps(local_directory):
  return sorted(int(p.name) for p in local_directory.iterdir() if p.name.isdigit())


def _restore_args(state):
  return jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), state)


def _listing(root):
  """Every path under `root`, relative, with OCDBT's random file names masked."""
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    paths += [re.sub(r"[0-9a-f]{32}", "<hash>", os.path.normpath(os.path.join(rel, n)))
              for n in dirnames + filenames]
  return sorted(set(paths))  # OCDBT may split data into more or fewer files


@pytest.fixture
def managers():
  opened = []

  def track(mgr):
    opened.append(mgr)
    return mgr

  yield track
  for mgr in opened:
    with contextlib.suppress(Exception):
      mgr.close()


# ----------------------------------------------------------------------------- the two forms


def test_choose_form_tells_the_two_forms_apart(tmp_path):
  mesh_like = object()
  form = constructor.choose_form
  opts = mtc.CheckpointManagerOptions
  assert form((tmp_path,), {}, opts) == constructor.PARENT_STYLE
  assert form((tmp_path, None), {"options": ocp.CheckpointManagerOptions()}, opts) == \
      constructor.PARENT_STYLE
  assert form((str(tmp_path),), {"local_directory": "/dev/shm/x"}, opts) == \
      constructor.PARENT_STYLE
  assert form((tmp_path / "l", tmp_path / "p", mesh_like, None), {}, opts) == \
      constructor.MULTI_TIER
  assert form((), {"local_directory": "a", "persistent_directory": "b"}, opts) == \
      constructor.MULTI_TIER
  assert form((tmp_path,), {"options": mtc.CheckpointManagerOptions()}, opts) == \
      constructor.MULTI_TIER
  assert form((), {"directory": tmp_path, "item_names": ("a",)}, opts) == \
      constructor.PARENT_STYLE
  # Orbax's own emergency options mean the multi-tier form too (converted there).
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
  assert form((tmp_path,), {"options": emergency.CheckpointManagerOptions()}, opts) == \
      constructor.MULTI_TIER


def test_wrong_mixes_get_clear_errors(shm_dir, mesh):
  with pytest.raises(TypeError, match="multi-tier form.*persistent_directory"):
    mtc.CheckpointManager(shm_dir / "p", options=mtc.CheckpointManagerOptions())
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
  with pytest.raises(TypeError, match="multi-tier form.*persistent_directory"):
    mtc.CheckpointManager(shm_dir / "p", options=emergency.CheckpointManagerOptions())
  with pytest.raises(TypeError, match="parent-style form takes options=ocp"):
    mtc.CheckpointManager(shm_dir / "p", options=mtc.PersistentCheckpointOptions())
  with pytest.raises(ValueError, match="global_mesh, local_options only apply to a RAM tier"):
    mtc.CheckpointManager(shm_dir / "p", global_mesh=mesh,
                          local_options=mtc.LocalCheckpointOptions())
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  with pytest.raises(ValueError, match="legacy `checkpointers`"):
    mtc.CheckpointManager(shm_dir / "p", checkpointer, local_directory=shm_dir / "l")
  checkpointer.close()
  assert not (shm_dir / "p").exists() and not (shm_dir / "l").exists()


# ----------------------------------------------------------------------------- one tier


def _exercise(mgr, mesh):
  """The same calls on any manager; returns what a user would observe."""
  seen = {}
  for step in range(6):
    state = _array_state(mesh, step)
    seen[f"saved{step}"] = mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave({"step": step})),
        metrics={"loss": float((step * 7) % 5)}, custom_metadata={"tag": f"s{step}"})
  mgr.wait_until_finished()
  seen["all_steps"] = list(mgr.all_steps())
  seen["latest"] = mgr.latest_step()
  seen["best"] = mgr.best_step()
  seen["metrics"] = {s: mgr.metrics(s) for s in mgr.all_steps()}
  seen["custom"] = {s: mgr.metadata(s).custom_metadata for s in mgr.all_steps()}
  seen["should_save"] = [mgr.should_save(s) for s in range(6, 12)]
  latest = mgr.latest_step()
  want = _array_state(mesh, latest)
  restored = mgr.restore(latest, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(restore_args=_restore_args(want)),
      meta=ocp.args.JsonRestore()))
  assert_trees_equal(restored.state, want)
  seen["meta"] = restored.meta
  mgr.delete(seen["all_steps"][0])
  seen["after_delete"] = list(mgr.all_steps())
  with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError):
    mgr.save(latest, args=ocp.args.Composite(state=ocp.args.PyTreeSave(want)), force=True)
  return seen


def _options():
  return ocp.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2, best_fn=lambda m:
                                      m["loss"], best_mode="min", keep_checkpoints_without_metrics=False)


def test_without_ram_tier_it_is_the_parent(shm_dir, mesh, managers):
  ours = managers(mtc.CheckpointManager(shm_dir / "ours", options=_options()))
  theirs = managers(ocp.CheckpointManager(shm_dir / "theirs", options=_options()))
  assert ours.local_directory is None and isinstance(ours.options, ocp.CheckpointManagerOptions)
  assert _exercise(ours, mesh) == _exercise(theirs, mesh)
  ours.close()
  theirs.close()
  assert _listing(shm_dir / "ours") == _listing(shm_dir / "theirs")


def test_ram_tier_keeps_the_parents_meaning(shm_dir, mesh, managers):
  ours = managers(mtc.CheckpointManager(shm_dir / "ours", options=_options(),
                                        local_directory=shm_dir / "ram"))
  theirs = managers(ocp.CheckpointManager(shm_dir / "theirs", options=_options()))
  got, want = _exercise(ours, mesh), _exercise(theirs, mesh)
  assert got == want
  assert ours.last_restore.tier == "local" and ours.last_restore.step == want["latest"]
  # The RAM tier holds copies of steps the parent still has (its retention applies to RAM too).
  ram_steps = _ram_steps(shm_dir / "ram")
  assert ram_steps and set(ram_steps) <= set(ours.all_steps())
  ours.close()
  theirs.close()
  assert _listing(shm_dir / "ours") == _listing(shm_dir / "theirs")


# ----------------------------------------------------------------------------- RAM tier


def test_restore_comes_from_ram_bit_exact(shm_dir, mesh, managers):
  options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3)
  mgr = managers(mtc.CheckpointManager(shm_dir / "p", options=options,
                                       local_directory=shm_dir / "ram"))
  assert mgr.global_mesh is None
  states = {}
  for step in range(4):
    states[step] = _array_state(mesh, step)
    assert mgr.save(step, args=ocp.args.PyTreeSave(states[step]))
  mgr.wait_until_finished()
  assert mgr.global_mesh == mesh  # taken from the first save's shardings
  assert mgr.all_steps() == [1, 2, 3]

  restored = mgr.restore(3, args=ocp.args.PyTreeRestore(abstract_of(states[3])))
  assert mgr.last_restore.tier == "local" and mgr.last_restore.step == 3
  assert_trees_equal(restored, states[3])

  # As the parent: an item saved with PyTreeSave is not restored with StandardRestore.
  mgr.last_restore = None
  with pytest.raises(ValueError, match="does not match with any registered handler"):
    mgr.restore(3, args=ocp.args.StandardRestore(abstract_of(states[3])))
  assert mgr.last_restore is None

  mgr.last_restore = None
  restored = mgr.restore(3, args=ocp.args.PyTreeRestore(restore_args=_restore_args(states[3])))
  assert mgr.last_restore.tier == "local"
  assert_trees_equal(restored, states[3])

  # Steps the RAM tier no longer holds (it keeps 1) come from `directory`, as before.
  mgr.last_restore = None
  restored = mgr.restore(1, args=ocp.args.PyTreeRestore(abstract_of(states[1])))
  assert mgr.last_restore is None
  assert_trees_equal(restored, states[1])

  # Per-leaf options the RAM tier cannot honour go to the parent, which casts as asked.
  cast = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=np.dtype(np.float32)),
                      states[3])
  restored = mgr.restore(3, args=ocp.args.PyTreeRestore(restore_args=cast))
  assert mgr.last_restore is None
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(restored))


def test_a_target_of_another_dtype_restores_as_the_parent(shm_dir, mesh, managers):
  """Issue 44: `StandardRestore` of another dtype casts (Orbax builds restore args from the
  target), and the RAM tier serves it with the same bits; `PyTreeRestore(item=...)` without
  restore args keeps the saved dtypes in Orbax, so that restore stays the parent's."""
  options = ocp.CheckpointManagerOptions(save_interval_steps=1)
  ours = managers(mtc.CheckpointManager(shm_dir / "ours", options=options,
                                        local_directory=shm_dir / "ram"))
  theirs = managers(ocp.CheckpointManager(shm_dir / "theirs", options=options))
  state = _array_state(mesh, 3)
  for mgr in (ours, theirs):
    mgr.save(3, args=ocp.args.Composite(a=ocp.args.PyTreeSave(state),
                                        b=ocp.args.StandardSave(state)))
    mgr.wait_until_finished()
  bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, jax.numpy.bfloat16 if x.dtype == np.float32 else x.dtype, sharding=x.sharding),
      abstract_of(state))
  for name, args, tier in (("b", ocp.args.StandardRestore(bf16), "local"),
                           ("a", ocp.args.PyTreeRestore(bf16), None)):
    ours.last_restore = None
    got = ours.restore(3, args=ocp.args.Composite(**{name: args}))[name]
    want = theirs.restore(3, args=ocp.args.Composite(**{name: args}))[name]
    assert_trees_equal(got, want)
    assert getattr(ours.last_restore, "tier", None) == tier, name
  assert got["params"]["w"].dtype == np.float32  # PyTreeRestore(item) does not cast
  assert want["params"]["w"].dtype == np.float32


def test_a_fresh_manager_restores_from_ram_and_survives_corruption(shm_dir, mesh, managers):
  options = ocp.CheckpointManagerOptions(save_interval_steps=1)
  state = _array_state(mesh, 5)
  with mtc.CheckpointManager(shm_dir / "p", options=options,
                             local_directory=shm_dir / "ram") as mgr:
    mgr.save(5, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

  mgr = managers(mtc.CheckpointManager(shm_dir / "p", options=options,
                                       local_directory=shm_dir / "ram"))
  assert mgr.latest_step() == 5
  restored = mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(abstract_of(state))))
  assert mgr.last_restore.tier == "local"
  assert_trees_equal(restored.state, state)
  mgr.close()

  # One flipped bit in the data, then one in the manifest: both must send the restore to
  # `directory`, never hand back wrong bytes or crash.
  # The first shard starts at offset 0 of the data file.
  for name, offset in ((DATA, 0), (MANIFEST, 100)):
    flip_byte(shm_dir / "ram" / "5" / name, offset, mask=0x80)
    mgr = managers(mtc.CheckpointManager(shm_dir / "p", options=options,
                                         local_directory=shm_dir / "ram"))
    restored = mgr.restore(None, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(abstract_of(state))))
    assert mgr.last_restore is None or mgr.last_restore.tier != "local", name
    assert_trees_equal(restored.state, state)
    mgr.close()


def test_own_ram_schedule_and_delete(shm_dir, mesh, managers):
  mgr = managers(mtc.CheckpointManager(
      shm_dir / "p", options=ocp.CheckpointManagerOptions(save_interval_steps=4),
      local_directory=shm_dir / "ram", global_mesh=mesh,
      local_options=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2)))
  states = {}
  for step in range(6):
    states[step] = _array_state(mesh, step)
    mgr.save(step, args=ocp.args.PyTreeSave(states[step]))
  mgr.wait_until_finished()
  assert mgr.should_save(7) and not mgr.should_save(5)
  # RAM every step (keeps 2), `directory` every 4 steps.
  assert mgr.all_steps() == [0, 4, 5]
  restored = mgr.restore(None, args=ocp.args.PyTreeRestore(abstract_of(states[5])))
  assert mgr.last_restore.tier == "local" and mgr.last_restore.step == 5
  assert_trees_equal(restored, states[5])
  mgr.delete(4)
  assert mgr.all_steps() == [0, 5]
  assert not (shm_dir / "ram" / "4").exists() and not (shm_dir / "p" / "4").exists()


def test_unsupported_items_go_to_directory_alone(shm_dir, mesh, managers):
  mgr = managers(mtc.CheckpointManager(
      shm_dir / "p", options=ocp.CheckpointManagerOptions(save_interval_steps=1),
      local_directory=shm_dir / "ram"))
  state = _array_state(mesh, 1)
  cast = jax.tree.map(lambda _: ocp.SaveArgs(dtype=np.dtype(np.float32)), state)
  assert mgr.save(1, args=ocp.args.PyTreeSave(state, save_args=cast))
  mgr.wait_until_finished()
  assert mgr.all_steps() == [1]
  assert _ram_steps(shm_dir / "ram") == []


def test_harness_variable_adds_a_ram_tier(shm_dir, mesh, managers, monkeypatch):
  monkeypatch.setenv(constructor.LOCAL_ROOT_ENV, str(shm_dir / "root"))
  mgr = managers(mtc.CheckpointManager(shm_dir / "p",
                                       options=ocp.CheckpointManagerOptions()))
  expected = constructor.local_directory_from_env(shm_dir / "p", 0)
  assert mgr.local_directory == expected and str(expected).startswith(str(shm_dir / "root"))
  state = _array_state(mesh, 2)
  mgr.save(0, args=ocp.args.PyTreeSave(state))
  mgr.wait_until_finished()
  assert _ram_steps(expected) == [0]


def test_a_read_only_manager_deletes_nothing_as_orbax(shm_dir, mesh, managers):
  """Orbax's read-only manager skips delete: the step stays in both tiers and in all_steps,
  also when the read-only manager took the RAM folder over from a writer in this process."""
  options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3)
  writer = managers(mtc.CheckpointManager(shm_dir / "p", options=options,
                                          local_directory=shm_dir / "ram"))
  state = _array_state(mesh, 0)
  assert writer.save(0, args=ocp.args.PyTreeSave(state))
  writer.wait_until_finished()
  reader = managers(mtc.CheckpointManager(
      shm_dir / "p", options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      local_directory=shm_dir / "ram"))
  reader.delete(0)
  assert reader.all_steps() == [0]
  assert _ram_steps(shm_dir / "ram") == [0] and (shm_dir / "p" / "0").is_dir()
  restored = reader.restore(0, args=ocp.args.PyTreeRestore(abstract_of(state)))
  assert reader.last_restore.tier == "local"
  assert_trees_equal(restored, state)
