"""orbax_mtc.CheckpointManager in one process, at its edges: targets that do not match, unusable
local folders, metadata and delete, the .restore link, state types, forced older steps, private
files, a second manager, Orbax's non-replicated folder."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, assert_host_equal, assert_trees_equal, make_state
from manager_support import (
  _bad_abstract,
  _composite,
  _flip_first_shard,
  _lkg_consistent,
  _Moments,
  _options,
  _persistent_steps,
  _save_range,
  _TrainState,
)

import orbax_mtc as mtc
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local.format import DATA, MANIFEST
from orbax_mtc.local.lock import read_holder
from orbax_mtc.local.store import LocalTier, committed_steps, read_manifest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("change", ["shape", "keys"])
@pytest.mark.parametrize("how", ["args", "abstract_state"])
def test_mismatched_abstract_state_local(open_manager, dirs, mesh, change, how):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  bad, fragments = _bad_abstract(states[6], change)
  if how == "args":
    target_mgr = mgr
    call = lambda: mgr.restore(None, args=ocp.args.Composite(  # noqa: E731
        state=ocp.args.PyTreeRestore(item=bad)))
  else:
    mgr.close()
    target_mgr = open_manager(abstract=bad)
    call = lambda: target_mgr.restore(None)  # noqa: E731
  with pytest.raises(mtc.AbstractStateMismatchError) as info:
    call()
  assert isinstance(info.value, ValueError)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
  # Nothing committed was lost, and the right target restores it.
  assert committed_steps(dirs[0]) == [4, 6]
  assert target_mgr.all_steps() == [0, 4, 6]
  restored = target_mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_of(states[6]))))
  assert target_mgr.last_restore.step == 6
  assert_trees_equal(restored.state, states[6])


@pytest.mark.parametrize("change", ["shape", "keys"])
def test_mismatched_abstract_state_persistent(open_manager, dirs, mesh, change):
  """From the persistent tier too, a mismatch is an AbstractStateMismatchError naming the leaf
  (Orbax alone raises a plain ValueError without the leaf for a shape)."""
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 5))
  mgr.close()
  shutil.rmtree(dirs[0])
  again = open_manager()
  bad, fragments = _bad_abstract(states[4], change)
  with pytest.raises(mtc.AbstractStateMismatchError) as info:
    again.restore(None, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=bad)))
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
  assert _persistent_steps(dirs[1]) == [0, 4]
  restored = again.restore(None)
  assert again.last_restore.tier == "persistent"
  assert_trees_equal(restored.state, states[4])


def _cast_target(abstract):
  """The abstract state with its float32 leaves asked for as bfloat16 and its float64 numpy
  leaf as float32 (ints, bfloat16 and Python scalars as saved)."""

  def cast(leaf):
    if isinstance(leaf, np.ndarray):
      return leaf.astype(np.float32)
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.dtype == np.float32:
      return jax.ShapeDtypeStruct(leaf.shape, jax.numpy.bfloat16, sharding=leaf.sharding)
    return leaf
  return jax.tree.map(cast, abstract)


@pytest.mark.parametrize("tier", ["local", "elastic", "persistent"])
def test_a_target_of_another_dtype_is_cast_as_orbax_casts(open_manager, dirs, mesh, tier):
  """Issue 44: a target of another dtype is cast on restore, as Orbax casts, from every tier:
  the same bits as plain Orbax's restore of the same step with the same target. A cast
  restore writes nothing back (the folders keep the bytes as saved)."""
  mgr = open_manager()
  _save_range(mgr, mesh, range(0, 5))  # step 4: in RAM and persistent
  mgr.close()
  target_mesh = mesh
  if tier == "elastic":
    target_mesh = jax.make_mesh((4, 1), ("data", "model"), devices=jax.devices()[:4])
  elif tier == "persistent":
    shutil.rmtree(dirs[0])
  target = _cast_target(abstract_of(make_state(target_mesh, 4)))
  args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target))
  with ocp.CheckpointManager(dirs[1]) as plain:
    want = plain.restore(4, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))))
  assert want.state["params"]["w"].dtype == jax.numpy.bfloat16  # Orbax casts
  with mtc.CheckpointManager(dirs[0], dirs[1], target_mesh, target,
                             options=_options()) as again:
    for restored in (again.restore(4, args=args), again.restore(4)):  # args, abstract_state
      assert (again.last_restore.step, again.last_restore.tier) == (4, tier)
      assert_trees_equal(restored.state, want.state)
  if tier != "persistent":
    saved = read_manifest(dirs[0] / "4").items["state"].leaves
    assert {leaf.dtype for leaf in saved} == {"float32", "float64", "bfloat16", "int32",
                                              "int64"}
    as_saved = make_state(target_mesh, 4)
    with mtc.CheckpointManager(dirs[0], dirs[1], target_mesh, abstract_of(as_saved),
                               options=_options()) as again:
      assert_trees_equal(again.restore(4).state, as_saved)
      assert again.last_restore.tier == tier


def test_code_written_for_orbax_emergency_manager_runs_unchanged(dirs, mesh, tmp_path):
  """Issue 44: Orbax's emergency options objects and `persistent_non_replicated_directory`
  (per-process items such as a data iterator's position, in the `dataset` item), called as
  Orbax's emergency manager is called: the `dataset` item goes to a plain Orbax manager on
  that folder, and args that name only `dataset` restore the state beside it, as Orbax."""
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

  dataset_dir = tmp_path / "dataset"
  options = emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
      persistent=emergency.PersistentCheckpointOptions(save_interval_steps=2))
  abstract = abstract_of(make_state(mesh))
  with mtc.CheckpointManager(local_directory=dirs[0], persistent_directory=dirs[1],
                             global_mesh=mesh, abstract_state=abstract, options=options,
                             persistent_non_replicated_directory=dataset_dir) as mgr:
    for step in range(4):
      mgr.save(step, ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh, step)),
                                        dataset=ocp.args.JsonSave({"position": step})))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [0, 2, 3]
    assert ocp.CheckpointManager(dataset_dir).all_steps() == [0, 2]
    restored = mgr.restore(2, ocp.args.Composite(dataset=ocp.args.JsonRestore()))
    assert set(restored.keys()) == {"state", "dataset"}
    assert_trees_equal(restored.state, make_state(mesh, 2))
    assert restored.dataset == {"position": 2}


def test_local_directory_is_a_file(open_manager, shm_dir):
  path = shm_dir / "afile"
  path.write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    open_manager(local=path)


def test_same_local_and_persistent_directory(open_manager, shm_dir):
  with pytest.raises(ValueError, match="different"):
    open_manager(local=shm_dir / "same", persistent=shm_dir / "same")


def test_a_mesh_that_does_not_fit_leaves_nothing_claimed(dirs, mesh):
  local, persistent = dirs
  bad = mtc.CheckpointManagerOptions(replication=mtc.ReplicationOptions(replica_axis="nope"))
  with pytest.raises(ValueError, match="nope"):
    mtc.CheckpointManager(local, persistent, mesh, abstract_of(make_state(mesh)), options=bad)
  # The refused manager released the RAM folder (a released claim names no holder) and
  # closed its Orbax manager; a good one then saves and restores as usual.
  assert read_holder(local) is None
  with mtc.CheckpointManager(local, persistent, mesh, abstract_of(make_state(mesh))) as mgr:
    assert read_holder(local).pid == os.getpid()
    mgr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh))))
    mgr.wait_until_finished()
    assert_trees_equal(mgr.restore(0).state, make_state(mesh))
    assert mgr.last_restore.tier == "local"


def test_local_directory_not_writable_read_only_mount(tmpfs_mount, open_manager):
  mount = tmpfs_mount("ro,size=64k")
  with pytest.raises(ValueError, match="not writable"):
    open_manager(local=mount)
  with pytest.raises(ValueError, match="Cannot create local_directory"):
    open_manager(local=mount / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (chmod 0o500)")
def test_local_directory_not_writable_permissions(open_manager, shm_dir):
  path = shm_dir / "ro"
  path.mkdir()
  path.chmod(0o500)
  try:
    with pytest.raises(ValueError, match="not writable"):
      open_manager(local=path)
  finally:
    path.chmod(0o700)


def test_full_ram_disk(tmpfs_mount, open_manager, dirs, mesh):
  local = tmpfs_mount("size=512k") / "local"
  small = make_state(mesh, 0)
  mgr = open_manager(_options(persistent_every=1000, local_keep=1), local=local)
  assert mgr.save(0, args=_composite(small))
  mgr.wait_until_finished()
  big = make_state(mesh, 2, scale=1024)  # w alone is 8192 x 6 float32 = 192 KiB ...
  big["params"]["w2"] = big["params"]["w"] + 1  # ... and more than the 512 KiB disk in all
  big["params"]["w3"] = big["params"]["w"] + 2
  with pytest.raises(mtc.CheckpointError) as info:
    mgr.save(2, args=_composite(big))
    mgr.wait_until_finished()
  message = str(info.value)
  assert info.value.__cause__.errno == errno.ENOSPC and "process 0" in message
  assert "step 2" in message and "Committed steps are untouched" in message
  assert committed_steps(local) == [0]
  assert not [p for p in local.iterdir() if p.name.startswith(".tmp-")]
  restored = mgr.restore(None)
  assert mgr.last_restore.step == 0 and mgr.last_restore.tier == "local"
  assert_trees_equal(restored.state, small)
  # The manager is still usable: a state that fits saves and restores.
  assert mgr.save(4, args=_composite(make_state(mesh, 4)))
  mgr.wait_until_finished()
  assert_trees_equal(mgr.restore(None).state, make_state(mesh, 4))


def test_steps_metadata_and_delete(open_manager, dirs, mesh):
  mgr = open_manager()
  states, _ = _save_range(mgr, mesh, range(0, 7))
  assert mgr.all_steps() == [0, 4, 6]
  assert mgr.latest_step() == 6
  assert mgr.best_step() == 6

  local_only = mgr.item_metadata(6)  # only in RAM
  tree = local_only.state
  assert tree["params"]["w"].shape == (8, 6) and tree["params"]["w"].dtype == np.float32
  assert tree["params"]["b"].dtype == jax.numpy.bfloat16
  assert tree["ids"].shape == (4, 4) and tree["ids"].dtype == np.int32
  assert isinstance(tree["layers"], list) and tree["layers"][0].shape == (4, 2)
  step_meta = mgr.metadata(6)
  assert step_meta.item_metadata.state["params"]["w"].shape == (8, 6)
  assert step_meta.commit_timestamp_nsecs > 0

  persistent = mgr.item_metadata(4).state  # persistent (and local)
  persistent_tree = getattr(persistent, "tree", persistent)
  assert persistent_tree["params"]["w"].shape == (8, 6)
  assert persistent_tree["params"]["w"].dtype == np.float32
  assert mgr.metadata(4) is not None
  assert mgr.item_metadata(0).state is not None  # persistent only

  mgr.delete(6)  # local only
  assert committed_steps(dirs[0]) == [4]
  assert mgr.all_steps() == [0, 4] and mgr.latest_step() == 4
  mgr.delete(4)  # both tiers
  assert committed_steps(dirs[0]) == []
  assert _persistent_steps(dirs[1]) == [0]
  assert mgr.all_steps() == [0] and mgr.latest_step() == 0
  mgr.delete(5)  # nowhere: a no-op
  restored = mgr.restore(None)
  assert mgr.last_restore.step == 0 and mgr.last_restore.tier == "persistent"
  assert_trees_equal(restored.state, states[0])


def test_single_item_local_metadata_is_bare_tree(open_manager, mesh):
  mgr = open_manager(_options(persistent_every=1000))
  _save_range(mgr, mesh, [2], single=True)
  meta = mgr.item_metadata(2)
  assert set(meta) == set(make_state(mesh))
  assert meta["params"]["w"].shape == (8, 6)


def test_pending_step_counts_and_delete_waits(open_manager, dirs, mesh):
  mgr = open_manager()
  mgr.save(2, args=_composite(make_state(mesh, 2)))
  assert 2 in mgr.all_steps()  # in flight or committed
  mgr.delete(2)
  assert mgr.all_steps() == []
  assert committed_steps(dirs[0]) == []


def test_donating_the_state_while_its_write_is_in_flight_keeps_the_saved_bytes(
    open_manager, mesh, monkeypatch):
  """save() stages CPU arrays without copying them; a training step that donates those arrays
  while the write is still running must neither change the step nor get wrong inputs."""
  writing, release = threading.Event(), threading.Event()
  write = LocalTier.write

  def held_write(self, staged, *args):
    writing.set()
    assert release.wait(60), "the test never released the write"
    return write(self, staged, *args)

  monkeypatch.setattr(LocalTier, "write", held_write)
  mgr = open_manager(_options(local_every=2, persistent_every=10**6))
  state = make_state(mesh, 5)
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)
  arrays = {k: v for k, v in state.items() if isinstance(v, jax.Array)}
  train_step = jax.jit(lambda tree: jax.tree.map(lambda x: x * 2, tree), donate_argnums=0)
  mgr.save(2, args=_composite(state))
  assert writing.wait(60)
  stepped = jax.block_until_ready(train_step(arrays))  # the write has not read a byte yet
  release.set()
  mgr.wait_until_finished()
  for name, value in stepped.items():
    np.testing.assert_array_equal(np.asarray(value), want[name] * 2)
  restored = mgr.restore(2).state
  assert mgr.last_restore.tier == "local"
  assert_host_equal(restored, want)


def test_lkg_follows_delete_of_newest(open_manager, dirs, mesh):
  mgr = open_manager()
  _save_range(mgr, mesh, range(0, 7))
  _lkg_consistent(dirs[0])
  mgr.delete(6)
  _lkg_consistent(dirs[0])


def test_lkg_follows_fallback_from_corrupt_step(open_manager, dirs, mesh):
  mgr = open_manager()
  _save_range(mgr, mesh, range(0, 7))
  _flip_first_shard(dirs[0] / "6")
  mgr.restore(None)
  assert mgr.last_restore.step == 4
  _lkg_consistent(dirs[0])


def test_restore_of_an_older_step_keeps_newer_steps(open_manager, dirs, mesh):
  """restore(step) reads; like plain Orbax it must not delete committed newer steps (here
  step 8 is only in RAM, so deleting it loses it for good)."""
  mgr = open_manager(_options(local_keep=3, persistent_every=1000))
  states, _ = _save_range(mgr, mesh, range(0, 9))
  assert committed_steps(dirs[0]) == [4, 6, 8]
  assert _persistent_steps(dirs[1]) == [0]
  assert_trees_equal(mgr.restore(6).state, states[6])
  assert committed_steps(dirs[0]) == [4, 6, 8]
  assert mgr.latest_step() == 8
  assert_trees_equal(mgr.restore(None).state, states[8])
  assert mgr.last_restore.tier == "local"


def test_dataclass_and_namedtuple_state_restores_from_the_persistent_tier(open_manager, dirs,
                                                                           mesh):
  base = make_state(mesh, 3)
  w = base["params"]["w"]
  state = _TrainState(step=jax.numpy.asarray(3, dtype=jax.numpy.int32),
                      params={"w": w}, opt_state=(_Moments(mu=w + 1, nu=w * 2),))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), state)
  mgr = open_manager(abstract=abstract)
  mgr.save(0, args=_composite(state), force=True)
  mgr.wait_until_finished()
  mgr.close()
  shutil.rmtree(dirs[0])  # only the persistent tier has it now
  again = open_manager(abstract=abstract)
  restored = again.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract)))
  assert again.last_restore.tier == "persistent"
  assert isinstance(restored.state, _TrainState)
  assert_trees_equal(restored.state, state)


def test_forcing_a_step_already_in_ram_backs_that_copy_up(open_manager, dirs, mesh):
  """The final step is often on the RAM schedule only: save(step, force=True) then takes it
  to the persistent tier from RAM (Orbax would refuse a step that exists)."""
  mgr = open_manager(options=_options(persistent_every=1000))
  states, _ = _save_range(mgr, mesh, range(1, 7))
  # The first step is backed up (as Orbax saves the first step it sees); 6 is in RAM only.
  assert _persistent_steps(dirs[1]) == [1] and 6 in mgr.all_steps()
  assert mgr.save(6, args=_composite(states[6]), force=True)
  mgr.wait_until_finished()
  assert _persistent_steps(dirs[1]) == [1, 6]
  assert mgr.last_backup.step == 6 and mgr.last_backup.state == "done"
  mgr.close()
  shutil.rmtree(dirs[0])
  again = open_manager(options=_options(persistent_every=1000))
  restored = again.restore(None)
  assert (again.last_restore.step, again.last_restore.tier) == (6, "persistent")
  assert_trees_equal(restored.state, states[6])


def test_a_forced_save_of_an_older_step_keeps_the_newest_ram_steps_and_valid_links(
    open_manager, dirs, mesh):
  """RAM holds 7, 8, 9 with max_to_keep=3: save(5, force=True) goes to the persistent tier
  only; the RAM steps and the LKG link (naming 9) are untouched; a restart restores 9."""
  local_dir, persistent_dir = dirs
  mgr = open_manager(_options(local_every=1, persistent_every=1000, local_keep=3))
  states, _ = _save_range(mgr, mesh, range(7, 10))
  assert committed_steps(local_dir) == [7, 8, 9]
  old = make_state(mesh, 5)
  assert mgr.save(5, args=_composite(old), force=True)
  mgr.wait_until_finished()
  assert committed_steps(local_dir) == [7, 8, 9]
  assert 5 in _persistent_steps(persistent_dir)
  links = lkg.list_entries(local_dir)
  assert [e.step for e in links] == [9]
  assert os.readlink(local_dir / links[0].name) == lkg.link_target(9)
  assert mgr.all_steps()[-1] == 9 and 5 in mgr.all_steps()
  assert_trees_equal(mgr.restore(5).state, old)
  mgr.close()
  again = open_manager(_options(local_every=1, persistent_every=1000, local_keep=3))
  assert again.latest_step() == 9
  assert_trees_equal(again.restore(None).state, states[9])
  assert again.last_restore.tier == "local"


def test_manager_folders_and_files_are_private(open_manager, dirs, mesh):
  local_dir, _ = dirs
  mgr = open_manager(_options(local_every=1, persistent_every=1000))
  _save_range(mgr, mesh, range(0, 2))
  assert local_dir.stat().st_mode & 0o777 == 0o700
  step_dir = local_dir / "1"
  assert step_dir.stat().st_mode & 0o777 == 0o700
  for name in (DATA, MANIFEST):
    assert (step_dir / name).stat().st_mode & 0o777 == 0o600, name


def test_a_second_manager_in_the_same_process_takes_the_local_directory_over(
    open_manager, dirs, mesh):
  """As with Orbax's managers, a second manager on the same folders works: the first one's
  write in flight is finished at the takeover, after which it lists and reloads but refuses to
  save, restore or delete; close() on it is quiet."""
  first = open_manager(_options(local_every=1, persistent_every=1000))
  states, _ = _save_range(first, mesh, range(0, 3))
  states[3] = make_state(mesh, 3)
  first.save(3, args=_composite(states[3]))  # in flight while the second manager opens
  second = open_manager(_options(local_every=1, persistent_every=1000))
  assert second.all_steps() == [0, 2, 3]  # 0: persistent
  with pytest.raises(mtc.LocalDirectoryTakenOverError, match="made later in this process"):
    first.save(4, args=_composite(make_state(mesh, 4)), force=True)
  with pytest.raises(mtc.LocalDirectoryTakenOverError):
    first.restore(3)
  with pytest.raises(mtc.LocalDirectoryTakenOverError):
    first.delete(2)
  assert committed_steps(dirs[0]) == [2, 3]
  first.reload()  # listing still works: it lists what the newer manager holds
  assert first.all_steps() == [0, 2, 3]
  first.close()
  assert_trees_equal(second.restore(3).state, states[3])
  assert second.save(4, args=_composite(make_state(mesh, 4)))
  second.wait_until_finished()
  assert committed_steps(dirs[0]) == [3, 4]


def test_persistent_non_replicated_directory_keeps_the_dataset_item_as_orbax_does(
    dirs, mesh, tmp_path):
  """Orbax's emergency manager's third folder: the `dataset` item of each save goes to a plain
  Orbax manager there, on the persistent schedule; restore brings it back beside the state
  (from RAM or persistent)."""
  dataset_dir = tmp_path / "dataset"
  with mtc.CheckpointManager(dirs[0], dirs[1], mesh, abstract_of(make_state(mesh)),
                             options=_options(local_every=1, persistent_every=2),
                             persistent_non_replicated_directory=dataset_dir) as mgr:
    states = {}
    for step in range(4):
      states[step] = make_state(mesh, step)
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step]),
                                             dataset=ocp.args.JsonSave({"position": step})))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [0, 2, 3]  # RAM keeps 2 and 3; 0 and 2 are persistent
    assert ocp.CheckpointManager(dataset_dir).all_steps() == [0, 2]
    assert not any("dataset" in p.name for p in (dirs[0] / "2").iterdir())
    both = ocp.args.Composite(state=ocp.args.PyTreeRestore(), dataset=ocp.args.JsonRestore())
    restored = mgr.restore(2, args=both)
    assert mgr.last_restore.tier == "local"
    assert_trees_equal(restored.state, states[2])
    assert restored.dataset == {"position": 2}
    restored = mgr.restore(0, args=both)
    assert mgr.last_restore.tier == "persistent"
    assert_trees_equal(restored.state, states[0])
    assert restored.dataset == {"position": 0}
    # Without a dataset target the state alone comes back, as from Orbax's manager.
    assert set(mgr.restore(3).keys()) == {"state"}
