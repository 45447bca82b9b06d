"""Option validation (clear errors at construction) and last-known-good links."""

from __future__ import annotations

import os
import threading

import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, make_state

import orbax_mtc as mtc
from orbax_mtc.local import restore_links as lkg

pytestmark = pytest.mark.timeout(60)

EXPECTED_FORM = "<job>-s<step>-n<node_rank>-w<worker_index>.restore"

# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("cls", [mtc.LocalCheckpointOptions, mtc.PersistentCheckpointOptions])
@pytest.mark.parametrize("value", [0, -1, -100])
def test_non_positive_interval_rejected(cls, value):
  with pytest.raises(ValueError, match=rf"save_interval_steps must be a positive.*got {value}"):
    cls(save_interval_steps=value)


@pytest.mark.parametrize("cls", [mtc.LocalCheckpointOptions, mtc.PersistentCheckpointOptions])
@pytest.mark.parametrize("value", [2.5, 2.0, "2", True])
def test_non_int_interval_rejected(cls, value):
  with pytest.raises(TypeError, match="save_interval_steps must be an int"):
    cls(save_interval_steps=value)


def test_none_interval_rejected():
  with pytest.raises(ValueError, match="save_interval_steps"):
    mtc.LocalCheckpointOptions(save_interval_steps=None)


def test_keep_period_validated():
  with pytest.raises(ValueError, match="keep_period"):
    mtc.PersistentCheckpointOptions(keep_period=0)
  assert mtc.PersistentCheckpointOptions(keep_period=None).keep_period is None


@pytest.mark.parametrize("cls", [mtc.LocalCheckpointOptions, mtc.PersistentCheckpointOptions])
def test_max_to_keep_zero_rejected(cls):
  with pytest.raises(ValueError, match="max_to_keep must be >= 1"):
    cls(max_to_keep=0)
  with pytest.raises(ValueError, match="max_to_keep"):
    cls(max_to_keep=-3)
  with pytest.raises(TypeError, match="max_to_keep"):
    cls(max_to_keep=1.5)


def test_option_defaults():
  local = mtc.LocalCheckpointOptions()
  assert local.max_to_keep == 1
  assert local.save_interval_steps >= 1
  assert mtc.PersistentCheckpointOptions().max_to_keep is None
  options = mtc.CheckpointManagerOptions()
  assert options.job_name == "orbax"
  assert options.persistent_manager_options().save_interval_steps == \
      options.persistent.save_interval_steps


def test_both_peer_options_rejected():
  with pytest.raises(ValueError, match="peers_per_node.*peer_ranks.*not both"):
    mtc.ReplicationOptions(peers_per_node=1, peer_ranks=[[1], [0]])
  # Either one alone is fine.
  mtc.ReplicationOptions(peers_per_node=1)
  mtc.ReplicationOptions(peer_ranks=[[1], [0]])


@pytest.mark.parametrize("value", [-1, 1.0, True])
def test_bad_peers_per_node_rejected(value):
  with pytest.raises(ValueError, match="peers_per_node"):
    mtc.ReplicationOptions(peers_per_node=value)


@pytest.mark.parametrize("name", ["a/b", "/", "", "x\0y"])
def test_bad_job_name_rejected(name):
  with pytest.raises(ValueError, match="job_name"):
    mtc.CheckpointManagerOptions(job_name=name)


def test_bad_replica_axis_value_rejected():
  with pytest.raises(ValueError, match="replica_axis"):
    mtc.ReplicationOptions(replica_axis="")


@pytest.mark.parametrize("value", [-1, True, 1.0])
def test_bad_replica_axis_index_rejected(value):
  with pytest.raises(ValueError, match="replica_axis_index"):
    mtc.CheckpointManagerOptions(replica_axis_index=value)


def test_wrong_sub_options_type_rejected():
  with pytest.raises(TypeError, match="CheckpointManagerOptions.local must be an orbax_mtc"):
    mtc.CheckpointManagerOptions(local=mtc.PersistentCheckpointOptions())
  with pytest.raises(TypeError, match="persistent"):
    mtc.CheckpointManagerOptions(persistent=ocp.CheckpointManagerOptions())


def _manager(shm_dir, mesh, options):
  return mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                               abstract_of(make_state(mesh)), options=options)


def test_unknown_replica_axis_names_axis_and_mesh_axes(shm_dir, mesh):
  options = mtc.CheckpointManagerOptions(replication=mtc.ReplicationOptions(replica_axis="dp"))
  with pytest.raises(ValueError) as info:
    _manager(shm_dir, mesh, options)
  message = str(info.value)
  assert "'dp'" in message
  assert "'data'" in message and "'model'" in message


def test_replica_axis_index_out_of_range(shm_dir, mesh):
  options = mtc.CheckpointManagerOptions(replica_axis_index=2)
  with pytest.raises(ValueError, match=r"replica_axis_index=2 is out of range.*'data', 'model'"):
    _manager(shm_dir, mesh, options)


@pytest.mark.parametrize("axis_options, expected", [
    (dict(replication=mtc.ReplicationOptions(replica_axis="model")), "model"),
    (dict(replica_axis_index=1), "model"),
    (dict(), "data"),
])
def test_replica_axis_resolved(shm_dir, mesh, axis_options, expected):
  with _manager(shm_dir, mesh, mtc.CheckpointManagerOptions(**axis_options)) as mgr:
    assert mgr.replica_axis == expected


def test_wrong_options_type_passed_to_manager(shm_dir, mesh):
  with pytest.raises(TypeError, match="orbax_mtc.CheckpointManagerOptions"):
    _manager(shm_dir, mesh, ocp.CheckpointManagerOptions(save_interval_steps=2))
  with pytest.raises(TypeError, match="orbax_mtc.CheckpointManagerOptions"):
    _manager(shm_dir, mesh, mtc.LocalCheckpointOptions())


def test_wrong_mesh_type_passed_to_manager(shm_dir, mesh):
  with pytest.raises(TypeError, match="global_mesh"):
    mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", None,
                          abstract_of(make_state(mesh)))


# ----------------------------------------------------------------------------- lkg


@pytest.mark.parametrize("job, step, node, worker", [
    ("orbax", 0, 0, 0), ("my-job", 100, 3, 7), ("a-s1-n2-w3", 12345678901, 12, 0),
    ("job.with.dots", 5, 0, 1)])
def test_link_name_round_trip(job, step, node, worker):
  name = lkg.link_name(job, step, node, worker)
  assert name.endswith(".restore")
  entry = lkg.parse_link_name(name)
  assert (entry.job_name, entry.step, entry.node_rank, entry.worker_index, entry.name) == \
      (job, step, node, worker, name)
  assert entry.nothing_to_restore == (step == 0)


@pytest.mark.parametrize("name", [
    "orbax-s-n0-w0.restore", "orbax-s1-n0.restore", "orbax-s1-n0-w0", "orbax-s1-n0-w0.restore.tmp",
    "-s1-n0-w0.restore", "orbax-sX-n0-w0.restore", "orbax-s1-n-1-w0.restore", "restore", "",
    "orbax_s1_n0_w0.restore"])
def test_malformed_link_name_rejected(name):
  with pytest.raises(ValueError) as info:
    lkg.parse_link_name(name)
  message = str(info.value)
  assert EXPECTED_FORM in message
  assert repr(name) in message


def test_update_creates_relative_link_to_step(tmp_path):
  (tmp_path / "4").mkdir()
  (tmp_path / "4" / "manifest.json").write_text("{}")
  path = lkg.update(tmp_path, "job", 4, 0, 0)
  assert path == tmp_path / "job-s4-n0-w0.restore"
  assert path.is_symlink()
  assert os.readlink(path) == "4/manifest.json"
  assert path.resolve() == (tmp_path / "4" / "manifest.json").resolve()
  # A link to a file: a tool that removes every directory it finds in the folder (Orbax's
  # test_utils.empty_directory: rmtree refuses a symlink) unlinks it instead.
  assert path.is_file() and not path.is_dir()


def test_update_replaces_previous_link(tmp_path):
  for step in (2, 4, 6):
    (tmp_path / str(step)).mkdir()
    lkg.update(tmp_path, "job", step, 0, 0)
    entries = lkg.list_entries(tmp_path)
    assert [e.step for e in entries] == [step]
    assert os.readlink(tmp_path / entries[0].name) == lkg.link_target(step)
  # No temporary names left behind.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4", "6", "job-s6-n0-w0.restore"]


def test_update_leaves_other_nodes_and_jobs_alone(tmp_path):
  lkg.update(tmp_path, "job", 2, 0, 0)
  lkg.update(tmp_path, "job", 2, 1, 0)
  lkg.update(tmp_path, "job", 2, 0, 1)
  lkg.update(tmp_path, "other", 2, 0, 0)
  lkg.update(tmp_path, "job", 4, 0, 0)
  names = sorted(e.name for e in lkg.list_entries(tmp_path))
  assert names == sorted(["job-s4-n0-w0.restore", "job-s2-n1-w0.restore",
                          "job-s2-n0-w1.restore", "other-s2-n0-w0.restore"])
  lkg.remove_all(tmp_path, "job", 0, 0)
  assert "job-s4-n0-w0.restore" not in {e.name for e in lkg.list_entries(tmp_path)}
  assert len(lkg.list_entries(tmp_path)) == 3


def test_update_same_step_twice_is_idempotent(tmp_path):
  lkg.update(tmp_path, "job", 3, 0, 0)
  lkg.update(tmp_path, "job", 3, 0, 0)
  assert [e.name for e in lkg.list_entries(tmp_path)] == ["job-s3-n0-w0.restore"]
  assert os.readlink(tmp_path / "job-s3-n0-w0.restore") == lkg.link_target(3)


def _leftovers(directory):
  """Temporary links a process killed inside `update` would leave, and look-alikes."""
  uid = "0123456789abcdef0123456789abcdef"
  ours = [f".job-s3-n0-w0.restore.{uid}.tmp", f".job-s9-n0-w0.restore.{uid[::-1]}.tmp"]
  others = [f".job-s3-n1-w0.restore.{uid}.tmp",  # another node
            f".job-s3-n0-w1.restore.{uid}.tmp",  # another worker
            f".other-s3-n0-w0.restore.{uid}.tmp",  # another job
            f".job-s3-n10-w0.restore.{uid}.tmp"]  # a node rank that starts like ours
  for name in ours + others:
    os.symlink("3", directory / name)
  # Not symlinks, or not our names: never ours to remove.
  (directory / f".job-s4-n0-w0.restore.{uid}.tmp").mkdir()
  (directory / f".job-s5-n0-w0.restore.{uid}.tmp").write_text("x")
  (directory / ".job-s3-n0-w0.restore.tmp").symlink_to("3")  # the replicator's own temp name
  (directory / "notes.tmp").write_text("x")
  (directory / "3").mkdir()
  return ours


def test_update_removes_temporary_links_a_killed_update_left(tmp_path):
  ours = _leftovers(tmp_path)
  before = set(os.listdir(tmp_path))
  lkg.update(tmp_path, "job", 3, 0, 0)
  assert set(os.listdir(tmp_path)) == before - set(ours) | {"job-s3-n0-w0.restore"}


def test_remove_all_and_cleanup_temporary_remove_them_too(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  ours = _leftovers(tmp_path / "a")
  before = set(os.listdir(tmp_path / "a"))
  lkg.remove_all(tmp_path / "a", "job", 0, 0)
  assert set(os.listdir(tmp_path / "a")) == before - set(ours)
  ours = _leftovers(tmp_path / "b")
  before = set(os.listdir(tmp_path / "b"))
  removed = lkg.cleanup_temporary(tmp_path / "b", "job", 0, 0)
  assert sorted(p.name for p in removed) == sorted(ours)
  assert set(os.listdir(tmp_path / "b")) == before - set(ours)
  assert lkg.cleanup_temporary(tmp_path / "b", "job", 0, 0) == []
  assert lkg.cleanup_temporary(tmp_path / "missing", "job", 0, 0) == []


def test_a_failed_replace_leaves_no_temporary_link(tmp_path, monkeypatch):
  def fail(src, dst):
    raise OSError("disk gone")

  monkeypatch.setattr(lkg.os, "replace", fail)
  with pytest.raises(OSError, match="disk gone"):
    lkg.update(tmp_path, "job", 3, 0, 0)
  assert os.listdir(tmp_path) == []


def test_reader_always_sees_a_link_during_updates(tmp_path):
  """A concurrent reader never sees zero links for this node (replace, then unlink old)."""
  lkg.update(tmp_path, "job", 0, 0, 0)
  stop = threading.Event()
  seen_empty = []

  def reader():
    while not stop.is_set():
      if not _entries(tmp_path):
        seen_empty.append(True)

  thread = threading.Thread(target=reader)
  thread.start()
  try:
    for step in range(1, 200):
      lkg.update(tmp_path, "job", step, 0, 0)
  finally:
    stop.set()
    thread.join(10)
  assert not seen_empty
  assert [e.step for e in lkg.list_entries(tmp_path)] == [199]


def _entries(directory):
  try:
    return [p for p in os.listdir(directory) if p.endswith(".restore")]
  except FileNotFoundError:
    return []


def test_list_entries(tmp_path):
  assert lkg.list_entries(tmp_path / "missing") == []
  (tmp_path / "7").mkdir()
  (tmp_path / "unrelated.txt").write_text("x")
  (tmp_path / "job-s0-n0-w0.restore").write_text("")  # managed mode: nothing to restore
  lkg.update(tmp_path, "job", 7, 1, 0)
  entries = lkg.list_entries(tmp_path)
  assert [(e.step, e.node_rank, e.nothing_to_restore) for e in entries] == \
      [(0, 0, True), (7, 1, False)]
  (tmp_path / "bogus.restore").write_text("")
  with pytest.raises(ValueError, match="bogus.restore"):
    lkg.list_entries(tmp_path)
