"""The replicator file protocol's pure parts: replicator.yaml, restore entries, peers."""

from __future__ import annotations

import json
import os
import threading

import pytest
import replicator_sim

import orbax_mtc as mtc
from orbax_mtc.local.format import StepManifest
from orbax_mtc.managed import protocol as replicator_protocol
from orbax_mtc.managed import setup as managed_setup


def _config(**over):
  fields = dict(job_name="run1", node_rank=0, nodes=4, data_parallelism=2, peer_ranks=(2,),
                backup_interval_minutes=30)
  fields.update(over)
  return replicator_protocol.ReplicatorConfig(**fields)


def test_yaml_round_trip_and_the_simulator_reads_what_we_write():
  for config in (_config(), _config(peer_ranks=None, peers_per_node=1,
                                    backup_interval_minutes=None, backup_interval_steps=500)):
    text = config.to_yaml()
    assert replicator_protocol.ReplicatorConfig.from_yaml(text) == config
    fields = replicator_sim.validate(text)  # an independent reader
    assert fields["job-name"] == "run1" and fields["framework"] == "orbax"
  assert "peer-ranks: [2]" in _config().to_yaml()


@pytest.mark.parametrize("over, match", [
    (dict(peers_per_node=1), "exactly one of peer-ranks"),
    (dict(peer_ranks=None), "exactly one of peer-ranks"),
    (dict(peer_ranks=(0,)), "other than node-rank 0"),
    (dict(peer_ranks=(4,)), r"in \[0, 4\)"),
    (dict(peer_ranks=(2, 2)), "distinct"),
    (dict(backup_interval_steps=10), "exactly one of backup-interval"),
    (dict(backup_interval_minutes=None), "exactly one of backup-interval"),
    (dict(backup_interval_minutes=0), "must be > 0"),
    (dict(node_rank=4), "node-rank must be an int in"),
    (dict(data_parallelism=3), "divides nodes=4"),
    (dict(job_name="my job"), "without spaces"),
    (dict(peer_ranks=None, peers_per_node=4), "fewer than nodes"),
])
def test_bad_configs_are_refused_with_the_reason(over, match):
  with pytest.raises(ValueError, match=match):
    _config(**over)


@pytest.mark.parametrize("text, match", [
    ("job-name: [unclosed", "not valid YAML"),
    ("- a\n- b", "must be a mapping"),
    ("job-name: x\nframework: orbax\nnodes: 1\nnode-rank: 0\n", "missing key"),
    (_config().to_yaml() + "colour: blue\n", "unknown key"),
    (_config().to_yaml().replace("framework: orbax", "framework: pax"), "framework must be"),
])
def test_malformed_yaml_written_by_someone_else(text, match):
  with pytest.raises(ValueError, match=match):
    replicator_protocol.ReplicatorConfig.from_yaml(text)


def test_restore_entries_are_never_followed_blindly(tmp_path):
  local = tmp_path / "local"
  _step_folder(local / "20", 20, 1)
  _step_folder(local / ".replicator" / "restore" / "30", 30, 2)
  outside = _step_folder(tmp_path / "elsewhere" / "40", 40, 1)
  os.symlink("20", local / "job-s20-n1-w0.restore")
  os.symlink(str(outside), local / "job-s40-n1-w0.restore")  # outside the volume
  os.symlink(".replicator/restore/30", local / "job-s30-n2-w0.restore")  # another node
  (local / "not-a-valid-name.restore").touch()
  (local / "job-s50-n1-w0.restore").write_text("junk")  # a regular file with a step
  (local / "other-s60-n1-w0.restore").touch()  # another job's
  choice = replicator_protocol.choose_entry(local, node_rank=1, worker_index=0, job_name="job")
  assert choice.step == 20 and choice.target == (local / "20").resolve()
  reasons = "\n".join(choice.ignored)
  assert "outside" in reasons and "node 2 worker 0" in reasons
  assert "Malformed last-known-good entry" in reasons and "a regular file" in reasons
  assert "for job 'other'" in reasons
  assert replicator_protocol.take_entry(local, choice) == 20
  assert not list(local.glob("*.restore"))
  assert (local / "20").is_dir() and outside.is_dir()  # nothing outside was touched


def test_two_steps_for_one_node_is_an_error_and_step_zero_means_nothing(tmp_path):
  local = tmp_path / "local"
  _step_folder(local / ".replicator" / "restore" / "30", 30, 0)
  _step_folder(local / "20", 20, 0)
  os.symlink("20", local / "job-s20-n0-w0.restore")
  os.symlink(".replicator/restore/30", local / "job-s30-n0-w0.restore")
  with pytest.raises(replicator_protocol.ReplicatorError, match=r"different steps \[20, 30\]"):
    replicator_protocol.choose_entry(local, 0, 0)
  for p in local.glob("*.restore"):
    p.unlink()
  (local / "job-s0-n0-w0.restore").touch()
  choice = replicator_protocol.choose_entry(local, 0, 0)
  assert (choice.step, choice.target) == (0, None)
  assert replicator_protocol.take_entry(local, choice) is None
  assert (local / "20").is_dir()  # a "nothing" entry deletes no step


@pytest.mark.parametrize("own", ["damaged", "whole"])
def test_a_staged_step_takes_the_place_of_the_own_folder_which_is_set_aside(tmp_path, own):
  """The node's own folder of the step is never deleted: a damaged one (no manifest) is
  moved aside as damaged, a whole one as replaced (a restore still reads it if the staged
  copy turns out bad); both are removed with the step by retention."""
  local = tmp_path / "local"
  if own == "whole":
    _step_folder(local / "30", 30, 0, data=b"own")
  else:
    (local / "30").mkdir(parents=True)
    (local / "30" / "stale").touch()
  _step_folder(local / ".replicator" / "restore" / "30", 30, 0, data=b"staged")
  os.symlink(".replicator/restore/30", local / "job-s30-n0-w0.restore")
  assert replicator_protocol.take_entry(local, replicator_protocol.choose_entry(local, 0, 0)) == 30
  assert (local / "30" / "data.bin").read_bytes() == b"staged"
  (kept,) = [p for p in local.iterdir() if p.name.startswith(".")
             and p.name != ".replicator"]
  if own == "whole":
    assert kept.name.startswith(".replaced-30-")
    assert (kept / "30" / "data.bin").read_bytes() == b"own"
  else:
    assert kept.name.startswith(".damaged-30-") and (kept / "stale").exists()


def test_an_entry_naming_a_folder_without_its_manifest_moves_nothing(tmp_path):
  """Issue 40, case 9: a replicator copy that lost its manifest used to be accepted, and the
  node's own good folder of that step deleted to make room for it."""
  local = tmp_path / "local"
  _step_folder(local / "30", 30, 0, data=b"own")
  staged = local / ".replicator" / "restore" / "30"
  staged.mkdir(parents=True)
  (staged / "data.bin").write_bytes(b"staged")
  os.symlink(".replicator/restore/30", local / "job-s30-n0-w0.restore")
  choice = replicator_protocol.choose_entry(local, 0, 0)
  assert choice.step is None and "has no manifest.json" in choice.ignored[0], choice
  with pytest.raises(replicator_protocol.ReplicatorError, match="has no manifest.json"):
    replicator_protocol.take_entry(local, replicator_protocol.RestoreChoice(30, staged.resolve()))
  assert (local / "30" / "data.bin").read_bytes() == b"own" and staged.is_dir()


def _step_folder(path, step=None, process_index=None, manifest=None, data=b"x"):
  """A step folder as the RAM tier writes it: a manifest naming its step and process (valid:
  signed, with a data file as long as it says), or the `manifest` text given."""
  path.mkdir(parents=True)
  (path / "data.bin").write_bytes(data)
  if manifest is None and step is not None:
    manifest = StepManifest(step=step, process_index=process_index, process_count=8, items={},
                            data_size=0, created_at=0.0, default_item=False).to_json()
  if manifest is not None:
    (path / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes)
                                         else manifest.encode())
  return path


@pytest.mark.parametrize("name, target, build, reason", [
    ("manifest of another step", "90", lambda d: _step_folder(d / "90", 90, 1),
     "says step 90, not 100"),
    ("manifest of another process", "100", lambda d: _step_folder(d / "100", 100, 3),
     "says process_index 3, not 1"),
    ("a step being written", ".tmp-100-abc",
     lambda d: _step_folder(d / ".tmp-100-abc", 100, 1), "a hidden folder"),
    ("a retired step", ".spare-abc", lambda d: _step_folder(d / ".spare-abc", 100, 1),
     "a hidden folder"),
    ("a peer copy", "peers/3/100", lambda d: _step_folder(d / "peers" / "3" / "100", 100, 1),
     "under peers/"),
    ("the peers folder", "peers", lambda d: (d / "peers").mkdir(), "under peers/"),
    ("relative outside", "../elsewhere/100",
     lambda d: _step_folder(d.parent / "elsewhere" / "100", 100, 1), "outside"),
    ("a chain leading out", "hop",
     lambda d: (_step_folder(d.parent / "elsewhere" / "100", 100, 1),
                os.symlink(d.parent / "elsewhere" / "100", d / "hop")), "outside"),
    ("a chain into peers", "100",
     lambda d: (_step_folder(d / "peers" / "3" / "100", 100, 1),
                os.symlink("peers/3/100", d / "100")), "under peers/"),
    ("inside a step folder", "100/sub", lambda d: _step_folder(d / "100" / "sub", 100, 1),
     "neither directly in"),
    ("a staging folder's temporary copy", ".replicator/restore/.tmp-100-x",
     lambda d: _step_folder(d / ".replicator" / "restore" / ".tmp-100-x", 100, 1),
     "a hidden folder"),
    ("another node's copy the replicator keeps", ".replicator/n3/100",
     lambda d: _step_folder(d / ".replicator" / "n3" / "100", 100, 3), "neither directly in"),
    ("a dangling link", "missing", lambda d: None, "cannot be followed"),
    ("a link loop", "loop", lambda d: os.symlink("loop", d / "loop"), "cannot be followed"),
    ("a file", "file", lambda d: (d / "file").write_text("x"), "not a folder"),
    ("malformed JSON", "100", lambda d: _step_folder(d / "100", manifest="{not json"),
     "cannot be read as JSON"),
    ("bad UTF-8", "100", lambda d: _step_folder(d / "100", manifest=b"\xff\xfe{"),
     "cannot be read as JSON"),
    ("too deep JSON", "100", lambda d: _step_folder(d / "100", manifest="[" * 100000),
     "cannot be read as JSON"),
    ("a JSON list", "100", lambda d: _step_folder(d / "100", manifest="[100, 1]"),
     "not a JSON object"),
    ("a string step", "100",
     lambda d: _step_folder(d / "100", manifest='{"step": "100", "process_index": 1}'),
     "no integer 'step'"),
    ("a boolean process index", "100",
     lambda d: _step_folder(d / "100", manifest='{"step": 100, "process_index": true}'),
     "no integer 'process_index'"),
    ("no process index", "100", lambda d: _step_folder(d / "100", manifest='{"step": 100}'),
     "no integer 'process_index'"),
    ("a manifest that is a folder", "100",
     lambda d: (d / "100" / "manifest.json").mkdir(parents=True), "cannot be read as JSON"),
])
def test_a_restore_entry_is_refused_and_moves_nothing(tmp_path, name, target, build, reason):
  local = tmp_path / "local"
  local.mkdir()
  build(local)
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  os.symlink(target, local / "job-s100-n1-w0.restore")
  choice = replicator_protocol.choose_entry(local, node_rank=1, worker_index=0, job_name="job")
  assert (choice.step, choice.target) == (None, None), name
  assert len(choice.ignored) == 1 and choice.ignored[0].startswith("job-s100-n1-w0.restore: ")
  assert reason in choice.ignored[0], choice.ignored[0]
  assert replicator_protocol.take_entry(local, choice) is None
  # Only the entry is gone: no folder was moved, renamed or deleted.
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_connect_logs_a_refused_entry_and_restores_nothing(tmp_path, monkeypatch):
  local = tmp_path / "local"
  _step_folder(local / "90", 90, 0)
  os.symlink("90", local / "run1-s100-n0-w0.restore")
  monkeypatch.setattr(replicator_protocol, "handshake", lambda *a, **k: None)
  warnings = []
  monkeypatch.setattr(replicator_protocol.logging, "warning",
                      lambda msg, *a: warnings.append(msg % a))
  config = _config(nodes=1, peer_ranks=(), data_parallelism=1)
  assert replicator_protocol.connect(local, config, 0, timeout_s=5, poll_s=0.01) is None
  assert any("says step 90, not 100" in w for w in warnings), warnings
  assert any("no usable restore entry" in w for w in warnings), warnings
  assert sorted(p.name for p in local.iterdir()) == ["90"]


@pytest.mark.parametrize("target", ["100", ".replicator/restore/100"])
def test_a_restore_entry_naming_its_step_and_process_is_taken(tmp_path, target):
  local = tmp_path / "local"
  _step_folder(local / target, 100, 1)
  _step_folder(local / "peers" / "3" / "100", 100, 3)  # a peer copy is left alone
  os.symlink(target, local / "job-s100-n1-w0.restore")
  choice = replicator_protocol.choose_entry(local, node_rank=1, worker_index=0, job_name="job")
  assert (choice.step, choice.target, choice.ignored) == (100, (local / target).resolve(), ())
  assert replicator_protocol.take_entry(local, choice) == 100
  manifest = json.loads((local / "100" / "manifest.json").read_text())
  assert (manifest["step"], manifest["process_index"]) == (100, 1)
  assert not list(local.glob("*.restore")) and not (local / ".replicator" / "restore" / "100").exists()
  assert (local / "peers" / "3" / "100" / "manifest.json").is_file()
  # process_index is the node rank unless given.
  _step_folder(local / "200", 200, 7)
  os.symlink("200", local / "job-s200-n1-w0.restore")
  assert replicator_protocol.choose_entry(local, 1, 0, process_index=7).step == 200
  assert replicator_protocol.choose_entry(local, 1, 0).step is None


def test_take_entry_refuses_a_hand_made_choice_of_a_peer_copy(tmp_path):
  local = tmp_path / "local"
  peer = _step_folder(local / "peers" / "3" / "100", 100, 3)
  choice = replicator_protocol.RestoreChoice(100, peer.resolve())
  with pytest.raises(replicator_protocol.ReplicatorError, match="under peers/"):
    replicator_protocol.take_entry(local, choice)
  assert peer.is_dir() and not (local / "100").exists()


def test_agreement_across_processes():
  assert replicator_protocol.agree([8, 8, 8]) == 8
  assert replicator_protocol.agree([0, 0]) == 0
  assert replicator_protocol.agree([8, 0]) is None


def test_peers_follow_orbax_with_slices_and_ask_for_peers_without():
  # 2 slices of 2 nodes: the node at the same index in the other slice (Orbax's rule).
  assert managed_setup.peers_for(0, 4, 2, None) == ((2,), None)
  assert managed_setup.peers_for(3, 4, 2, None) == ((1,), None)
  # One slice: Orbax would write no peers; we ask for one so FSDP-only jobs are protected.
  assert managed_setup.peers_for(1, 4, 1, None) == (None, 1)
  assert managed_setup.peers_for(0, 1, 1, None) == ((), None)
  assert managed_setup.peers_for(0, 4, 2, 3) == (None, 3)


def test_managed_options_validate():
  with pytest.raises(ValueError, match="mode must be one of"):
    mtc.CheckpointManagerOptions(mode="gke")
  with pytest.raises(ValueError, match="peers_per_node must be an int >= 0"):
    mtc.ManagedOptions(peers_per_node=-1)
  with pytest.raises(ValueError, match="timeout_seconds must be a number of seconds > 0"):
    mtc.ManagedOptions(timeout_seconds=0)
  options = mtc.CheckpointManagerOptions(
      mode="managed", job_name="run7",
      persistent=mtc.PersistentCheckpointOptions(backup_interval_minutes=30))
  config = managed_setup.config_for_manager(options, None, 0, 1)
  assert (config.job_name, config.peer_ranks, config.backup_interval_minutes,
          config.backup_interval_steps) == ("run7", (), 30, None)


def test_handshake_waits_for_the_old_file_and_reports_failure(tmp_path):
  """Against the simulator's own loop, in threads: an old file is taken first; a fatal answer
  becomes ReplicatorError and the file is removed."""
  local = tmp_path / "node0"
  local.mkdir()
  (local / "replicator.yaml").write_text(_config(job_name="old", nodes=1, peer_ranks=(),
                                                 data_parallelism=1).to_yaml())
  (local / "replicator.failed").write_text("from the previous run\n")
  args = type("Args", (), dict(volume=str(local), volume_pattern=str(tmp_path / "node{rank}"),
                               backup=str(tmp_path / "backup"), errors=None, fail=None))
  sim = replicator_sim.Simulator(args)
  stop = threading.Event()

  def daemon():
    while not stop.is_set():
      if (local / "replicator.yaml").exists():
        sim.take_config()
      stop.wait(0.01)

  thread = threading.Thread(target=daemon, daemon=True)
  thread.start()
  try:
    new = _config(job_name="new", nodes=1, peer_ranks=(), data_parallelism=1)
    assert replicator_protocol.connect(local, new, 0, timeout_s=30, poll_s=0.01) is None
    assert sim.config["job-name"] == "new"
    sim.fail = "disk is read-only"
    with pytest.raises(replicator_protocol.ReplicatorError, match="disk is read-only"):
      replicator_protocol.handshake(local, new, timeout_s=30, poll_s=0.01)
    assert not (local / "replicator.failed").exists()
  finally:
    stop.set()
    thread.join(5)


def test_initialize_takes_every_argument_of_orbax_function_of_that_name():
  import inspect

  from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization

  theirs = inspect.signature(initialization.initialize_multi_tier_checkpointing).parameters
  ours = inspect.signature(mtc.initialize_multi_tier_checkpointing).parameters
  assert list(ours)[0] == list(theirs)[0] == "local_checkpoint_directory"
  for name, param in theirs.items():
    assert name in ours, name
    assert ours[name].default == param.default, name
  with pytest.raises(ValueError, match="colocated Python"):
    mtc.initialize_multi_tier_checkpointing("/tmp/x", run_name="r", use_colocated_python=True)
