"""`process_state`: per-process items' args, bytes and persistent handler, in one process.

The multi-process behaviour (peers, SIGTERM, a corrupt entry, plain Orbax) is in
tests/test_iterators.py; here the pieces it rests on, and a single-process manager round trip.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_mtc as mtc
from orbax_mtc import item_args, process_state
from orbax_mtc.process_state import GRAIN, JSON, ProcessTarget

grain = pytest.importorskip("grain")


def _loader_iterator():
  sampler = grain.samplers.IndexSampler(num_records=64, shuffle=True, num_epochs=1, seed=3,
                                        shard_options=grain.sharding.NoSharding())
  return iter(grain.DataLoader(data_source=grain.sources.RangeDataSource(0, 64, 1),
                               sampler=sampler, operations=[grain.transforms.Batch(4)],
                               worker_count=0))


def _dataset_iterator():
  return iter(grain.MapDataset.range(64).shuffle(seed=3).to_iter_dataset().batch(4))


def test_formats_are_recognised_from_the_args():
  it = _dataset_iterator()
  assert process_state.save_format(mtc.ProcessJsonSave({"a": 1})) == JSON
  assert process_state.save_format(grain.checkpoint.CheckpointSave(it)) == GRAIN
  assert process_state.restore_format(mtc.ProcessJsonRestore()) == JSON
  assert process_state.restore_format(grain.checkpoint.CheckpointRestore(it)) == GRAIN
  assert process_state.save_format(ocp.args.JsonSave({"a": 1})) is None
  assert process_state.restore_format(ocp.args.PyTreeRestore()) is None


@pytest.mark.parametrize("make", [_loader_iterator, _dataset_iterator])
def test_a_grain_state_is_set_only_when_settled(make):
  it = make()
  next(it)
  data = process_state.encode(GRAIN, it)
  expected = next(it)
  fresh = make()
  pending = process_state.decode(ProcessTarget(GRAIN, fresh), data)
  assert isinstance(pending, process_state.PendingIteratorState)
  # Not yet moved: a restore that ends elsewhere leaves the iterator as it was.
  assert np.array_equal(next(make()), next(fresh))
  fresh = make()
  settled = process_state.settle({"iter": process_state.PendingIteratorState(
      ProcessTarget(GRAIN, fresh), data), "other": 5})
  assert settled["iter"] is fresh and settled["other"] == 5
  assert np.array_equal(next(fresh), expected)
  # As Grain's own handler writes it: JSON text either way.
  json.loads(data.decode())


def test_json_values_round_trip_and_bad_values_are_named():
  data = process_state.encode(JSON, {"epoch": 2, "seen": [1, 2]})
  assert process_state.decode(ProcessTarget(JSON), data) == {"epoch": 2, "seen": [1, 2]}
  assert process_state.decode(ProcessTarget(JSON, raw=True), data) == data
  with pytest.raises(TypeError, match="Item 'pos'.*JSON-serialisable"):
    item_args.split_save_args(ocp.args.Composite(pos=mtc.ProcessJsonSave({1, 2})))
  with pytest.raises(TypeError, match="Grain iterator"):
    process_state.encode(GRAIN, object())


def test_restore_args_need_the_iterator():
  with pytest.raises(ValueError, match="CheckpointRestore\\(iterator\\)"):
    item_args.restore_targets(ocp.args.Composite(iter=grain.checkpoint.CheckpointRestore(None)),
                              None)
  targets, single = item_args.restore_targets(
      ocp.args.Composite(pos=mtc.ProcessJsonRestore()), None)
  assert targets == {"pos": ProcessTarget(JSON)} and single is False


def test_the_handler_writes_and_reads_this_process_file(tmp_path):
  handler = process_state.ProcessJsonHandler()
  handler.save(tmp_path, args=mtc.ProcessJsonSave({"i": 7}))
  assert json.loads((tmp_path / "process_0-of-1.json").read_text()) == {"i": 7}
  assert handler.restore(tmp_path, args=mtc.ProcessJsonRestore()) == {"i": 7}
  (tmp_path / "process_0-of-1.json").rename(tmp_path / "process_0-of-2.json")
  with pytest.raises(FileNotFoundError, match="process_0-of-2.json.*process count"):
    handler.restore(tmp_path, args=mtc.ProcessJsonRestore())


def test_a_manager_keeps_the_iterator_in_ram_and_in_the_persistent_step(shm_dir, mesh):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from orbax_mtc import arrays

  state = {"w": jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("data")))}
  options = mtc.CheckpointManagerOptions(
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=2))
  it = _loader_iterator()
  next(it)
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                             arrays.abstract_tree(state), options=options) as mgr:
    mgr.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                        iter=grain.checkpoint.CheckpointSave(it),
                                        pos=mtc.ProcessJsonSave({"step": 2})))
    expected = next(it)
    mgr.wait_until_finished()
    assert mgr.item_metadata(2)["iter"] is None
    fresh = _loader_iterator()
    restored = mgr.restore(2, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=arrays.abstract_tree(state)),
        iter=grain.checkpoint.CheckpointRestore(fresh), pos=mtc.ProcessJsonRestore()))
    assert mgr.last_restore.tier == "local"
    assert restored.iter is fresh and restored.pos == {"step": 2}
    assert np.array_equal(next(fresh), expected)
    # An iterator that refuses the saved state (another data source): a clear error.
    other = iter(grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 32, 1), worker_count=0,
        sampler=grain.samplers.IndexSampler(num_records=32, shuffle=False, num_epochs=1,
                                            shard_options=grain.sharding.NoSharding())))
    with pytest.raises(mtc.AbstractStateMismatchError, match="refused the state saved"):
      mgr.restore(2, args=ocp.args.Composite(iter=grain.checkpoint.CheckpointRestore(other)))
    # Asked for as the wrong kind, or missing: clear errors, nothing deleted.
    with pytest.raises(mtc.AbstractStateMismatchError, match="per-process state"):
      mgr.restore(2, args=ocp.args.Composite(iter=ocp.args.JsonRestore()))
    with pytest.raises(mtc.MissingItemError) as missing:
      mgr.restore(2, args=ocp.args.Composite(loader=mtc.ProcessJsonRestore()))
    assert missing.value.item == "loader"
    assert mgr.all_steps() == [2]
  # The RAM disk gone: the same from the persistent tier.
  shutil.rmtree(shm_dir / "local")
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                             arrays.abstract_tree(state), options=options) as mgr:
    fresh = _loader_iterator()
    restored = mgr.restore(2, args=ocp.args.Composite(
        iter=grain.checkpoint.CheckpointRestore(fresh), pos=mtc.ProcessJsonRestore()))
    assert mgr.last_restore.tier == "persistent"
    assert restored.pos == {"step": 2} and np.array_equal(next(fresh), expected)
  # The persistent step: Grain's own files, readable by plain Orbax.
  assert sorted(p.name for p in (shm_dir / "persistent" / "2" / "iter").iterdir()
                if p.suffix == ".json") == ["process_0-of-1.json"]
  fresh = _loader_iterator()
  with ocp.CheckpointManager(shm_dir / "persistent") as plain:
    restored = plain.restore(2, args=ocp.args.Composite(
        iter=grain.checkpoint.CheckpointRestore(fresh), pos=mtc.ProcessJsonRestore()))
  assert restored.pos == {"step": 2} and np.array_equal(next(fresh), expected)


def test_a_value_one_process_cannot_encode_fails_the_save_through_the_agreement(shm_dir, mesh):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from orbax_mtc import arrays

  state = {"w": jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("data")))}
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                             arrays.abstract_tree(state), options=options) as mgr:
    mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                        pos=mtc.ProcessJsonSave({"i": 1})))
    # The value is this process's own: its error is raised as the agreed CheckpointError
    # (every process raises it), and nothing of step 2 is committed.
    with pytest.raises(mtc.CheckpointError, match="save of step 2.*Item 'pos'.*JSON"):
      mgr.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                          pos=mtc.ProcessJsonSave({1, 2})))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1]
    mgr.save(3, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                        pos=mtc.ProcessJsonSave({"i": 3})))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 3]
