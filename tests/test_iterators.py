"""Per-process items in every tier: a real Grain data iterator's position and a per-process JSON
item survive a restart, a kill -9, a node loss, a SIGTERM, a corrupt copy, and go to the
persistent tier in the format plain Orbax and Grain read.

Two real JAX processes (`tests/mp_worker iterate`), each reading its own shard of a Grain
`DataLoader`. Step s consumes batch s and saves the state, the iterator (`grain.checkpoint.
CheckpointSave`) and `ProcessJsonSave({"step": s, ...})`. After a restore of step S the worker
prints the first batch it reads (NEXT); it must be batch S + 1 of an uninterrupted run of that
process, computed here from the same loader. The state is compared bit for bit, and the JSON
item must be this process's own (RESUMED ok=1).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal

import pytest
from mp_helpers import WORKER, assert_ok, child_env, mp_events, run_job, started_job, tail
from mp_worker import iterators

from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import copy_store as peer_store

pytest.importorskip("grain")

WAIT_S = 90
pytestmark = pytest.mark.timeout(300)
NPROCS = 2
# Pure data parallelism: the two processes are twins (same shards), so only a copy of a node's
# own folder, never its twin's folder, can give back its iterator position.
COMMON = ["--layout", "dp", "--local-interval", "1", "--local-keep", "2",
          "--persistent-interval", "4"]


class _Reference(dict):
  """Per process, the batches an uninterrupted run reads, in order (read as far as asked)."""

  def __missing__(self, process: int) -> _Batches:
    self[process] = _Batches(process)
    return self[process]


class _Batches(list):
  def __init__(self, process: int):
    super().__init__()
    self._iterator = iter(iterators.data_loader(process, NPROCS))

  def __getitem__(self, step: int) -> list[int]:
    while len(self) <= step:
      self.append([int(x) for x in next(self._iterator)])
    return super().__getitem__(step)


@pytest.fixture(scope="module")
def reference() -> _Reference:
  return _Reference()


def _cmd(persistent: pathlib.Path, *extra: str) -> list[str]:
  return ["iterate", "--persistent-dir", str(persistent), *COMMON, *extra]


def _wait(out, kind: str) -> None:
  nodes = set(range(NPROCS))
  if not out.wait_for(lambda lines: nodes <= {n for n, _ in mp_events.events(lines, kind)},
                      WAIT_S):
    pytest.fail(f"no {kind} line from every process within {WAIT_S} s\n{tail(out)}")


def _resumed(out, step: int | None, reference, tiers: dict[int, str] | None = None) -> None:
  """Every process restored `step` (from `tiers[p]`, if given) with its own iterator
  position: its state and JSON item matched, and its next batch is batch step + 1."""
  resumed = dict(mp_events.events(out.lines, "RESUMED"))
  assert sorted(resumed) == list(range(NPROCS)), tail(out)
  following = {node: fields for node, fields in mp_events.events(out.lines, "NEXT")}
  for node, fields in sorted(resumed.items()):
    assert fields["ok"] == "1", f"process {node}: {fields['detail']}\n{tail(out)}"
    assert fields["step"] == str(step), (node, fields, tail(out))
    if tiers is not None:
      assert fields["tier"] == tiers[node], (node, fields)
    want_next = 0 if step is None else step + 1
    assert following[node]["step"] == str(want_next), following[node]
    got = [int(x) for x in following[node]["values"].split(",")]
    assert got == reference[node][want_next], (
        f"process {node} resumed at step {step} but read {got}, not batch {want_next} "
        f"{reference[node][want_next]}")


def _batches_match(out, reference) -> None:
  for node, fields in mp_events.events(out.lines, "BATCH"):
    step = int(fields["step"])
    assert [int(x) for x in fields["values"].split(",")] == reference[node][step], (node, step)


def _hold_and_kill(root, persistent, hold_at: int, *extra: str):
  """A job that resumes, trains to `hold_at`, waits until it is committed and copied, and
  is then killed with SIGKILL (process 1 first, as a lost node, then the rest)."""
  with started_job(_cmd(persistent, "--steps", "1000", "--hold-at", str(hold_at), *extra),
                   NPROCS, root) as (job, out):
    _wait(out, "CHECKPOINTED")
    os.kill(job.pids[1], signal.SIGKILL)
  return out


def _iter_entry(manifest: local_format.StepManifest) -> int:
  """The ordinal of the iterator item's entry among the manifest's shards."""
  entries = local_read.manifest_entries(manifest)
  return next(i for i, (name, _, _) in enumerate(entries) if name == "iter")


def _flip(path: pathlib.Path, offset: int) -> None:
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0x20]))


def _corrupt_own(root: pathlib.Path, node: int, step: int) -> None:
  folder = root / f"node{node}" / str(step)
  manifest = local_store.read_manifest(folder)
  shard = local_read.manifest_entries(manifest)[_iter_entry(manifest)][2]
  _flip(folder / local_format.DATA, shard.offset + 10)


def _corrupt_copy(root: pathlib.Path, holder: int, source: int, step: int) -> None:
  store = peer_store.PeerStore(root / f"node{holder}", max_to_keep=None)
  folder = store.source_dir(source) / str(step)
  at = store.meta(source, step).layout[_iter_entry(local_store.read_manifest(folder))]
  assert at >= 0, "the iterator entry is in the copy's own data"
  _flip(folder / local_format.DATA, at + 10)


# ----------------------------------------------------------------------------- tests


def test_restart_kill_and_node_loss_resume_every_iterator_where_it_was(shm_root, tmp_path,
                                                                       reference):
  persistent = tmp_path / "persistent"
  # A clean run of steps 0..3, then a restart: step 3 from every node's own folder.
  result, out = run_job(_cmd(persistent, "--steps", "4"), NPROCS, shm_root)
  assert_ok(result, out)
  _resumed(out, None, reference)
  _batches_match(out, reference)
  out = _hold_and_kill(shm_root, persistent, 7, "--expect-step", "3", "--expect-tier", "local")
  _resumed(out, 3, reference, {0: "local", 1: "local"})
  _batches_match(out, reference)
  # Killed (kill -9) after step 7: the restart resumes at 7.
  out = _hold_and_kill(shm_root, persistent, 9, "--expect-step", "7")
  _resumed(out, 7, reference, {0: "local", 1: "local"})
  # Node 1 is lost with its RAM: its folder and iterator come back from node 0's copy.
  shutil.rmtree(shm_root / "node1")
  result, out = run_job(_cmd(persistent, "--steps", "12", "--expect-step", "9"), NPROCS,
                        shm_root)
  assert_ok(result, out)
  _resumed(out, 9, reference, {0: "local", 1: "peer"})
  _batches_match(out, reference)
  # The recovered node holds its own step 9 again, with its own position.
  manifest = local_store.read_manifest(shm_root / "node1" / "11")
  assert manifest.items["iter"].kind == "process" and manifest.process_index == 1


def test_sigterm_saves_the_iterator_with_the_ondemand_step(shm_root, tmp_path, reference):
  persistent = tmp_path / "persistent"
  # RAM and persistent saves only on demand (and step 0): the resumed position can only come
  # from the on-demand save.
  cmd = _cmd(persistent, "--steps", "5000", "--preempt", "--ready-at", "2",
             "--local-interval", "1000", "--persistent-interval", "1000")
  with started_job(cmd, NPROCS, shm_root) as (job, out):
    _wait(out, "READY")
    os.kill(job.pids[0], signal.SIGTERM)
    result = job.wait(WAIT_S)
  assert_ok(result, out)
  steps = {fields["step"] for _, fields in mp_events.events(out.lines, "PREEMPTED")}
  assert len(steps) == 1, tail(out)
  step = int(steps.pop())
  assert step >= 2
  result, out = run_job(_cmd(persistent, "--steps", str(step + 2), "--expect-step", str(step),
                             "--expect-tier", "local"), NPROCS, shm_root)
  assert_ok(result, out)
  _resumed(out, step, reference, {0: "local", 1: "local"})
  assert step in local_store.committed_steps(shm_root / "node0")


def test_a_corrupt_iterator_falls_back_like_a_corrupt_shard(shm_root, tmp_path, reference):
  persistent = tmp_path / "persistent"
  result, out = run_job(_cmd(persistent, "--steps", "6"), NPROCS, shm_root)
  assert_ok(result, out)
  # Node 1's own iterator entry of step 5 is damaged: it takes node 0's copy of its folder.
  _corrupt_own(shm_root, 1, 5)
  result, out = run_job(_cmd(persistent, "--steps", "7", "--expect-step", "5"), NPROCS,
                        shm_root)
  assert_ok(result, out)
  _resumed(out, 5, reference, {0: "local", 1: "peer"})
  # Step 6 damaged in both places that hold node 1's (its own folder and node 0's copy): no
  # process resumes at 6; every process resumes at 5 (node 1 from its rewritten folder).
  _corrupt_own(shm_root, 1, 6)
  _corrupt_copy(shm_root, 0, 1, 6)
  result, out = run_job(_cmd(persistent, "--steps", "8", "--expect-step", "5"), NPROCS,
                        shm_root)
  assert_ok(result, out)
  _resumed(out, 5, reference, {0: "local", 1: "local"})


def test_the_persistent_step_is_what_plain_orbax_and_grain_restore(shm_root, tmp_path,
                                                                   reference):
  persistent = tmp_path / "persistent"
  result, out = run_job(_cmd(persistent, "--steps", "6"), NPROCS, shm_root)
  assert_ok(result, out)
  # Grain's own files, one per process, and the JSON item's, in Orbax's step folder.
  for item in ("iter", "pos"):
    names = sorted(p.name for p in (persistent / "4" / item).iterdir()
                   if p.name.startswith("process_"))
    assert names == ["process_0-of-2.json", "process_1-of-2.json"], names
  saved = json.loads((persistent / "4" / "pos" / "process_1-of-2.json").read_text())
  assert saved == {"step": 4, "process": 1, "note": "after batch 4"}
  # A plain ocp.CheckpointManager with Grain's CheckpointRestore resumes every process.
  result, out = run_job(["plain-iterate", "--persistent-dir", str(persistent), *COMMON,
                         "--step", "4"], NPROCS, shm_root)
  assert_ok(result, out)
  _resumed(out, 4, reference)
  # With the RAM tier gone, orbax-mtc restores the same from the persistent tier.
  for node in range(NPROCS):
    shutil.rmtree(shm_root / f"node{node}")
  result, out = run_job(_cmd(persistent, "--steps", "6", "--expect-step", "4",
                             "--expect-tier", "persistent"), NPROCS, shm_root)
  assert_ok(result, out)
  _resumed(out, 4, reference, {0: "persistent", 1: "persistent"})


def test_another_mesh_of_the_same_process_count_keeps_every_iterator(shm_root, tmp_path,
                                                                      reference):
  # Saved on (data=2, model=1), restarted on (data=1, model=2): the arrays are rebuilt on the
  # new mesh, and each process's position comes from its own saved rank's folder.
  persistent = tmp_path / "persistent"
  same_shapes = ("--shape-axes", "2,1")
  result, out = run_job(_cmd(persistent, "--steps", "6", *same_shapes), NPROCS, shm_root)
  assert_ok(result, out)
  result, out = run_job(_cmd(persistent, "--steps", "8", *same_shapes, "--replicas", "1",
                             "--expect-step", "5", "--expect-tier", "elastic"), NPROCS,
                        shm_root)
  assert_ok(result, out)
  _resumed(out, 5, reference, {0: "elastic", 1: "elastic"})
  _batches_match(out, reference)
  for node in range(NPROCS):  # the steps after it were saved on the new mesh, with positions
    manifest = local_store.read_manifest(shm_root / f"node{node}" / "7")
    assert manifest.items["iter"].kind == "process" and manifest.process_index == node


def test_another_process_count_is_refused_with_a_clear_error(shm_root, tmp_path):
  persistent = tmp_path / "persistent"
  result, out = run_job(_cmd(persistent, "--steps", "6"), NPROCS, shm_root)
  assert_ok(result, out)
  # One process now: its own folder is node 0's of a 2-process save (an elastic restore), and
  # the persistent files are process_*-of-2.json. Neither is this process's position.
  result, out = run_job(_cmd(persistent, "--steps", "8"), 1, shm_root, devices=2)
  assert result.returncode != 0, tail(out)
  text = out.text()
  assert "per-process state" in text and "iter" in text, tail(out)
  # Nothing committed was lost.
  assert local_store.committed_steps(shm_root / "node1") == [4, 5]
  assert sorted(int(p.name) for p in persistent.iterdir() if p.name.isdigit()) == [0, 4]


def test_the_worker_command_line_is_importable():
  # `python tests/mp_worker iterate --help` works without JAX distributed.
  import subprocess
  import sys

  result = subprocess.run([sys.executable, str(WORKER), "iterate", "--help"], env={
      **os.environ, **child_env()}, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0 and "--hold-at" in result.stdout, result.stderr
