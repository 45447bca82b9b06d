"""Preemption: a real SIGTERM to real processes, one agreed on-demand step, exit, restore.

Every job runs `tests/mp_worker preempt`: after restoring (if anything) it trains and saves
until a test sends `kill -TERM` to one of its processes; every process must then agree on one
step S (`reached_preemption(S)` True everywhere, printed as PREEMPTED), save S to every tier
although S is on no schedule (local every 2 steps, persistent every 1000: a persistent step S
can only come from the on-demand save), and exit as told:
  exit-after  `exit_after_ondemand_checkpoint=True`: save(S) never returns, the process exits 0;
  self-exit   the loop exits itself once `mgr.should_exit()` (EXITING);
  after-steps training goes on for a few steps (one process without `jax.distributed`, where
              the manager's own SIGTERM handler stands in for JAX's preemption notifier).
Then, from the folders alone: no node committed a step after S, S verifies, its
`ondemand.json` names S, the persistent tier holds S; and a restarted job restores S bit for
bit from the RAM tier (the worker's `RESULT ... ok=1`).

Timing is injected by the worker's hooks, never by sleeping here: a SIGTERM while an ordinary
save is being written (`--hook write`), a second SIGTERM while the on-demand step is being
written (`--hook ondemand-write` waits for a go file), a SIGTERM while restore() reads RAM
(`--hook restore`). The hooks wait (bounded) until `preemption.notice_time()` knows the signal.
The node that gets the signal is drawn from a seeded RNG (ORBAX_MTC_PREEMPT_SEED replays).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from mp_helpers import (
  WORKER,
  assert_ok,
  assert_private,
  assert_results,
  child_env,
  mp_events,
  started_job,
  tail,
)

from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.tools import launch

LAUNCH_TIMEOUT_S = 90  # each job's own limit: a hang shows as a failed job ...
WAIT_S = 60  # ... as does a line that never comes ...
pytestmark = pytest.mark.timeout(240)  # ... well before pytest-timeout fires
SEED = int(os.environ.get("ORBAX_MTC_PREEMPT_SEED", "20250612"))

# Local every 2 steps; persistent every 1000 (so only step 0 and the on-demand step get there).
ARGS = ["--local-interval", "2", "--persistent-interval", "1000"]
SECONDS_KEYS = {"agreement", "local", "peers", "persistent", "total"}
DEFAULT_GRACE_S = 270.0



def _rng(request) -> random.Random:
  return random.Random(f"{SEED}-{request.node.name}")


# ----------------------------------------------------------------------------- launching


def run_job(command: list[str], nprocs: int, root: pathlib.Path, *, devices: int = 2):
  with started_job(command, nprocs, root, devices=devices) as (job, out):
    result = job.wait(LAUNCH_TIMEOUT_S)
  return result, out


def _single_env() -> dict[str, str]:
  """One process without `jax.distributed`: no launcher variables, 2 CPU devices."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("ORBAX_MTC_")}
  env.update(child_env(), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=launch.merge_xla_flags(env.get("XLA_FLAGS"), 2))
  return env


@contextlib.contextmanager
def started_single(command: list[str]):
  """One mp_worker process in a session of its own, output collected; SIGKILLed (with
  anything it spawned) on leaving the block."""
  out = mp_events.LineCollector()
  proc = subprocess.Popen([sys.executable, str(WORKER), *command], env=_single_env(),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)

  def relay():
    for raw in iter(proc.stdout.readline, b""):
      out.write(raw.decode("utf-8", errors="replace"))

  reader = threading.Thread(target=relay, daemon=True)
  reader.start()
  try:
    yield proc, out
  finally:
    if proc.poll() is None:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=5)
    proc.stdout.close()


def wait_exit(proc, out) -> int:
  try:
    return proc.wait(timeout=LAUNCH_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"process still running {LAUNCH_TIMEOUT_S} s later\n{tail(out)}")


# ----------------------------------------------------------------------------- output


def nodes_with(lines: list[str], kind: str) -> set[int]:
  return {node for node, _ in mp_events.events(lines, kind)}


def wait_all(out, kind: str, nodes, timeout_s: float = WAIT_S) -> None:
  """Waits until every node in `nodes` printed a `kind` line; fails (with the log) if not."""
  wanted = set(nodes)
  if not out.wait_for(lambda lines: wanted <= nodes_with(lines, kind), timeout_s):
    pytest.fail(f"no {kind} line from nodes {sorted(wanted - nodes_with(out.lines, kind))} "
                f"within {timeout_s} s\n{tail(out)}")


def ondemand_step(out, nprocs: int) -> int:
  """The one step every node said PREEMPTED for (exactly one each, the same everywhere)."""
  steps: dict[int, list[int]] = {}
  for node, fields in mp_events.events(out.lines, "PREEMPTED"):
    steps.setdefault(node, []).append(int(fields["step"]))
  assert sorted(steps) == list(range(nprocs)), f"PREEMPTED missing on some node\n{tail(out)}"
  assert all(len(s) == 1 for s in steps.values()), f"several sync points: {steps}"
  values = {s[0] for s in steps.values()}
  assert len(values) == 1, f"nodes disagree on the on-demand step: {steps}\n{tail(out)}"
  assert not mp_events.events(out.lines, "ERROR"), tail(out)
  return values.pop()


# ----------------------------------------------------------------------------- folders


def persistent_steps(directory: pathlib.Path) -> list[int]:
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def read_ondemand(node_dir: pathlib.Path, step: int) -> dict:
  path = node_dir / str(step) / "ondemand.json"
  assert path.is_file(), f"{path} missing; folder holds {sorted(os.listdir(path.parent))}"
  record = json.loads(path.read_text())
  assert record["step"] == step, record
  assert set(record["seconds"]) == SECONDS_KEYS, record
  assert all(isinstance(v, (int, float)) and v >= 0 for v in record["seconds"].values()), record
  assert isinstance(record["persistent"], bool), record
  return record


def check_ondemand_folders(root: pathlib.Path, nprocs: int, step: int,
                           persistent: pathlib.Path, *, signalled_after: float,
                           last: bool = True) -> list[dict]:
  """The on-demand step is committed and verifies on every node (and, with `last`, nothing
  newer was committed), its ondemand.json describes it, and the persistent tier holds it."""
  records = []
  for node in range(nprocs):
    node_dir = root / f"node{node}"
    steps = committed_steps(node_dir)
    assert step in steps, f"node {node}: on-demand step {step} not committed; holds {steps}"
    if last:
      assert max(steps) == step, f"node {node} committed {steps} after the on-demand step {step}"
    for s in steps:
      manifest = verify_step(node_dir / str(s))
      assert (manifest.step, manifest.process_index, manifest.process_count) == (s, node, nprocs)
    records.append(read_ondemand(node_dir, step))
  backups = persistent_steps(persistent)
  assert step in backups, f"persistent tier holds {backups}, not the on-demand step {step}"
  if last:
    assert max(backups) == step, backups
  for record in records:
    assert record["persistent"] is True, record
    assert 0 < record["budget_seconds"] <= DEFAULT_GRACE_S, record
    # The notice's time is the job's, read back by every node (not each node's own clock).
    assert record["signal_time"] is not None, record
    assert signalled_after - 1.0 <= record["signal_time"] <= time.time() + 1.0, (
        record, signalled_after)
    assert abs(record["signal_time"] - records[0]["signal_time"]) < 1e-3, records
    assert record["seconds"]["total"] >= record["seconds"]["local"], record
  return records


def restore_job(root: pathlib.Path, persistent: pathlib.Path, nprocs: int, step: int, *,
                devices: int = 2, extra=()) -> None:
  """A restarted job restores `step` bit for bit from every node's RAM tier."""
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *ARGS,
                         "--expect-step", str(step), "--expect-tier", "local", *extra],
                        nprocs, root, devices=devices)
  assert_ok(result, out)
  assert_results(out, nprocs, step=step, tier="local")


def preempt_cmd(persistent: pathlib.Path, *extra: str) -> list[str]:
  return ["preempt", "--persistent-dir", str(persistent), *ARGS, *extra]


def sigterm(pid: int) -> float:
  """Sends a preemption notice; returns the time just before it."""
  sent = time.time()
  os.kill(pid, signal.SIGTERM)
  return sent


# ----------------------------------------------------------------------------- tests


def test_two_processes_exit_after_ondemand_checkpoint(shm_root, tmp_path, request):
  persistent = tmp_path / "persistent"
  victim = _rng(request).randrange(2)
  with started_job(preempt_cmd(persistent, "--exit-after"), 2, shm_root) as (job, out):
    wait_all(out, "READY", range(2))
    sent = sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  assert result.returncodes == [0, 0], result
  step = ondemand_step(out, 2)
  # save() did not return at the on-demand step: the manager ended the process.
  assert not mp_events.events(out.lines, "ONDEMAND-SAVED"), tail(out)
  check_ondemand_folders(shm_root, 2, step, persistent, signalled_after=sent)
  restore_job(shm_root, persistent, 2, step)


def test_four_processes_jumping_steps_copies_ondemand_step_to_peers(shm_root, tmp_path,
                                                                     request):
  persistent = tmp_path / "persistent"
  victim = _rng(request).randrange(4)
  with started_job(preempt_cmd(persistent, "--exit-after", "--stride", "3"), 4, shm_root,
                   devices=1) as (job, out):
    wait_all(out, "READY", range(4))
    sent = sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  step = ondemand_step(out, 4)
  # Steps jump by 3 (0, 3, 6, ...); the sync point still lands on a step the loop runs.
  assert step % 3 == 0, step
  check_ondemand_folders(shm_root, 4, step, persistent, signalled_after=sent)
  for node in range(4):  # step folders, peer copies, ondemand.json, the lock: all private
    assert assert_private(shm_root / f"node{node}") > 10
  for source in range(4):
    holders = []
    for holder in range(4):
      if holder == source:
        continue
      store = peer_store.PeerStore(shm_root / f"node{holder}", max_to_keep=None)
      if (source, step) in store.copies():
        manifest, _ = store.read(source, step, shm_root / f"node{holder}" / str(step))
        assert (manifest.step, manifest.process_index) == (step, source)
        holders.append(holder)
    assert holders, (f"no node holds a committed copy of node {source}'s on-demand step "
                     f"{step} under {peer_store.PEERS}/{source}/{step}")
  restore_job(shm_root, persistent, 4, step, devices=1)


def test_sigterm_while_an_ordinary_save_is_being_written(shm_root, tmp_path, request):
  persistent = tmp_path / "persistent"
  victim = _rng(request).randrange(2)
  command = preempt_cmd(persistent, "--exit-after", "--hook", "write", "--hook-step", "4")
  with started_job(command, 2, shm_root) as (job, out):
    wait_all(out, "HOOK-WRITING", [victim])
    sent = sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  # Every node's writer saw the notice while it was writing step 4.
  noticed = {n: f["known"] for n, f in mp_events.events(out.lines, "HOOK-NOTICE")}
  assert noticed == {0: "1", 1: "1"}, tail(out)
  step = ondemand_step(out, 2)
  # reached_preemption(4) had answered before the write of 4 began, so S comes later.
  assert step > 4, step
  check_ondemand_folders(shm_root, 2, step, persistent, signalled_after=sent)
  restore_job(shm_root, persistent, 2, step)


def test_second_sigterm_while_the_ondemand_step_is_written(shm_root, tmp_path):
  persistent = tmp_path / "persistent"
  markers = tmp_path / "markers"
  markers.mkdir()
  command = preempt_cmd(persistent, "--exit-after", "--hook", "ondemand-write",
                        "--marker-dir", str(markers))
  with started_job(command, 2, shm_root) as (job, out):
    wait_all(out, "READY", range(2))
    sent = sigterm(job.pids[0])
    wait_all(out, "HOOK-ONDEMAND", range(2))
    sigterm(job.pids[0])  # again, while its on-demand write is in progress
    sigterm(job.pids[1])  # and the other node's first, equally late
    (markers / "go").touch()
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  assert result.returncodes == [0, 0], result
  assert {f["found"] for _, f in mp_events.events(out.lines, "HOOK-GO")} == {"1"}, tail(out)
  step = ondemand_step(out, 2)
  hooked = {int(f["step"]) for _, f in mp_events.events(out.lines, "HOOK-ONDEMAND")}
  assert hooked == {step}, (hooked, step)
  check_ondemand_folders(shm_root, 2, step, persistent, signalled_after=sent)
  restore_job(shm_root, persistent, 2, step)


def _single_restore(local: pathlib.Path, persistent: pathlib.Path, *extra: str):
  proc = subprocess.run(
      [sys.executable, str(WORKER), "restore", "--local-dir", str(local), "--persistent-dir",
       str(persistent), *ARGS, *extra],
      env=_single_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
      timeout=LAUNCH_TIMEOUT_S, start_new_session=True)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-4000:]
  results = [fields for _, fields in mp_events.events(proc.stdout.splitlines(), "RESULT")]
  assert len(results) == 1 and results[0]["ok"] == "1", output[-4000:]
  return results[0]


def test_single_process_exit_after_ondemand_checkpoint(shm_root, tmp_path):
  persistent = tmp_path / "persistent"
  local = shm_root / "node0"
  local.mkdir(parents=True)
  with started_single(preempt_cmd(persistent, "--local-dir", str(local), "--exit-after")) \
      as (proc, out):
    wait_all(out, "READY", [0])
    sent = sigterm(proc.pid)
    code = wait_exit(proc, out)
  assert code == 0, f"exit status {code}\n{tail(out)}"
  step = ondemand_step(out, 1)
  assert not mp_events.events(out.lines, "ONDEMAND-SAVED"), tail(out)
  check_ondemand_folders(shm_root, 1, step, persistent, signalled_after=sent)
  result = _single_restore(local, persistent, "--expect-step", str(step), "--expect-tier",
                           "local")
  assert (result["step"], result["tier"]) == (str(step), "local"), result


def test_single_process_keeps_training_after_ondemand_checkpoint(shm_root, tmp_path):
  persistent = tmp_path / "persistent"
  local = shm_root / "node0"
  local.mkdir(parents=True)
  command = preempt_cmd(persistent, "--local-dir", str(local), "--local-keep", "5",
                        "--after-steps", "3")
  with started_single(command) as (proc, out):
    wait_all(out, "READY", [0])
    sent = sigterm(proc.pid)
    code = wait_exit(proc, out)
  assert code == 0, f"exit status {code}\n{tail(out)}"
  step = ondemand_step(out, 1)
  saved = mp_events.events(out.lines, "ONDEMAND-SAVED")
  assert len(saved) == 1 and saved[0][1]["step"] == str(step), tail(out)
  # mgr.last_ondemand describes it: that step, backed up to the persistent tier.
  assert (saved[0][1].get("info_step"), saved[0][1].get("persistent")) == (str(step), "1"), \
      saved
  done = mp_events.events(out.lines, "DONE")
  assert done and done[-1][1].get("step") == str(step + 3), tail(out)
  check_ondemand_folders(shm_root, 1, step, persistent, signalled_after=sent, last=False)
  result = _single_restore(local, persistent)
  assert int(result["step"]) >= step, result


def test_single_process_second_sigterm_while_the_ondemand_step_is_written(shm_root, tmp_path):
  # Without jax.distributed the manager's own handler gets both signals.
  persistent = tmp_path / "persistent"
  local = shm_root / "node0"
  local.mkdir(parents=True)
  markers = tmp_path / "markers"
  markers.mkdir()
  command = preempt_cmd(persistent, "--local-dir", str(local), "--exit-after", "--hook",
                        "ondemand-write", "--marker-dir", str(markers))
  with started_single(command) as (proc, out):
    wait_all(out, "READY", [0])
    sent = sigterm(proc.pid)
    wait_all(out, "HOOK-ONDEMAND", [0])
    sigterm(proc.pid)
    (markers / "go").touch()
    code = wait_exit(proc, out)
  assert code == 0, f"exit status {code}\n{tail(out)}"
  step = ondemand_step(out, 1)
  check_ondemand_folders(shm_root, 1, step, persistent, signalled_after=sent)
  result = _single_restore(local, persistent, "--expect-step", str(step), "--expect-tier",
                           "local")
  assert (result["step"], result["tier"]) == (str(step), "local"), result


def test_sigterm_during_restore(shm_root, tmp_path, request):
  persistent = tmp_path / "persistent"
  result, out = run_job(["save", "--steps", "5", "--persistent-dir", str(persistent), *ARGS],
                        2, shm_root)
  assert_ok(result, out)
  for node in range(2):
    assert committed_steps(shm_root / f"node{node}")[-1] == 4
  victim = _rng(request).randrange(2)
  command = preempt_cmd(persistent, "--exit-after", "--hook", "restore")
  with started_job(command, 2, shm_root) as (job, out):
    wait_all(out, "HOOK-RESTORING", [victim])
    sent = sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  noticed = {n: f["known"] for n, f in mp_events.events(out.lines, "HOOK-NOTICE")}
  assert noticed == {0: "1", 1: "1"}, tail(out)
  # The interrupted restore still restored step 4 bit for bit, then saved on demand after it.
  assert_results(out, 2, step=4, tier="local")
  step = ondemand_step(out, 2)
  assert step > 4, step
  check_ondemand_folders(shm_root, 2, step, persistent, signalled_after=sent)
  restore_job(shm_root, persistent, 2, step)


def test_loop_exits_itself_when_should_exit(shm_root, tmp_path, request):
  persistent = tmp_path / "persistent"
  victim = _rng(request).randrange(2)
  with started_job(preempt_cmd(persistent, "--self-exit"), 2, shm_root) as (job, out):
    wait_all(out, "READY", range(2))
    sent = sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  step = ondemand_step(out, 2)
  saved = dict(mp_events.events(out.lines, "ONDEMAND-SAVED"))
  exiting = dict(mp_events.events(out.lines, "EXITING"))
  assert sorted(saved) == sorted(exiting) == [0, 1], tail(out)
  for node in range(2):
    assert saved[node]["step"] == exiting[node]["step"] == str(step), tail(out)
    assert (saved[node].get("info_step"), saved[node].get("persistent")) == (str(step), "1")
  check_ondemand_folders(shm_root, 2, step, persistent, signalled_after=sent)


def test_the_dataset_items_orbax_manager_leaves_the_sync_point_alone(shm_root, tmp_path,
                                                                    request):
  """`persistent_non_replicated_directory`: Orbax's manager of the `dataset` item sees every
  save. Asking JAX's sync point itself with the user's steps (1000, 1001, ...) it would move
  the counter our step ids feed, and the notice would never fire; it is told the agreed step
  instead, and saves its item on demand there."""
  persistent, dataset = tmp_path / "persistent", tmp_path / "dataset"
  victim = _rng(request).randrange(2)
  command = preempt_cmd(persistent, "--self-exit", "--first-step", "1000", "--max-steps", "300",
                        "--dataset-dir", str(dataset))
  with started_job(command, 2, shm_root) as (job, out):
    wait_all(out, "READY", range(2))
    sigterm(job.pids[victim])
    result = job.wait(LAUNCH_TIMEOUT_S)
  assert_ok(result, out)
  step = ondemand_step(out, 2)
  assert step > 1000, step
  assert (dataset / str(step)).is_dir(), sorted(p.name for p in dataset.iterdir())
