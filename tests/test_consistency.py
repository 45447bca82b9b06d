"""One answer on every process, one outcome for every fault (issue: the multi-host contract).

Real multi-process jobs (2 and 4 JAX processes joined by `jax.distributed` on localhost, each
with its own folder under /dev/shm), driven through the public API by `tests/mp_worker`:

- after a node loss, `all_steps()`/`latest_step()` are the same everywhere, and
  `restore(latest_step())` restores, bit for bit, a step the replaced node holds only as a
  peer copy (it used to hang: the replaced node answered 0, the others 9);
- a restore target with another mesh layout raises AbstractStateMismatchError on every
  process and deletes nothing (it used to roll back silently and delete the RAM steps);
- a manifest that is valid JSON but wrong makes that copy unusable and every process falls
  back together (twin, older step) instead of one process crashing and the others hanging;
- a fault on one process (local write, LKG commit, backup read-back, peer send, restore
  read, write-back after a recovery) ends the same way on every process, within a bounded
  time, and a restart restores an agreed step bit for bit;
- two processes given one local directory both fail at construction with a clear error.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from mp_helpers import (
    assert_ok,
    assert_results,
    clone_run,
    mp_events,
    new_root,
    run_job,
    saved_run,
    started_job,
    tail,
)

from orbax_mtc.local.format import MANIFEST, MANIFEST_CRC_KEY, manifest_checksum
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps

pytestmark = pytest.mark.timeout(300)

# Each job waits at most this long for another process at an agreement: a lost process shows
# as an error naming it, well inside run_job's own limit.
AGREE = ["--agreement-timeout", "45"]


def events(out, kind: str) -> dict[int, dict[str, str]]:
  return {node: fields for node, fields in mp_events.events(out.lines, kind)}


def raised(out) -> dict[int, dict[str, str]]:
  return {int(f["process"]): f for _, f in mp_events.events(out.lines, "RAISED")}


def results(out) -> dict[int, dict[str, str]]:
  return mp_events.parse_results(out.lines)


def local_steps(root: pathlib.Path, node: int) -> list[int]:
  return committed_steps(root / f"node{node}")


def persistent_steps(directory: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
      if directory.is_dir() else []


@pytest.fixture
def root(request):
  path = new_root(request.node.name)
  yield path
  shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- 1. node loss

FSDP4 = ["--replicas", "1", "--peers-per-node", "1", "--local-interval", "1", "--local-keep",
         "2", "--persistent-interval", "1000", *AGREE]


def test_after_a_node_loss_latest_step_agrees_and_restores_a_peer_only_step(root, tmp_path):
  """4 processes, FSDP-only mesh (data=1), one peer each: RAM 8 and 9, persistent 0 only."""
  persistent = tmp_path / "persistent"
  result, out = run_job(["save", "--steps", "10", "--persistent-dir", str(persistent), *FSDP4],
                        4, root, devices=1, timeout_s=150)
  assert_ok(result, out)
  assert persistent_steps(persistent) == [0], tail(out)
  assert all(local_steps(root, n) == [8, 9] for n in range(4))
  shutil.rmtree(root / "node2")  # node 2 is replaced: its RAM folder is gone

  result, out = run_job(["steps", "--persistent-dir", str(persistent), "--restore-steps",
                         "8,latest", *FSDP4], 4, root, devices=1, timeout_s=150)
  assert_ok(result, out)
  steps = events(out, "STEPS")
  assert sorted(steps) == [0, 1, 2, 3], tail(out)
  for node, fields in steps.items():
    assert (fields["all"], fields["latest"]) == ("0,8,9", "9"), (node, tail(out))
  lines = [(int(f["process"]), f) for f in
           (fields for _, fields in mp_events.events(out.lines, "RESULT"))]
  assert len(lines) == 8, tail(out)
  for node, fields in lines:
    assert fields["ok"] == "1", (node, fields["detail"])
    assert fields["tier"] == ("peer" if node == 2 else "local"), (node, fields)
  assert sorted(int(f["step"]) for n, f in lines if n == 2) == [8, 9]
  # The replaced node holds the restored step in its own folder again.
  assert 9 in local_steps(root, 2)


# ----------------------------------------------------------------------------- shared run

TWO = ["--local-interval", "2", "--local-keep", "2", "--persistent-interval", "4", *AGREE]


@pytest.fixture(scope="module")
def dp_run(request, tmp_path_factory):
  """2 processes, pure data parallelism (each node is the other's twin): RAM {8, 10} on each,
  persistent {0, 4, 8}."""
  src = new_root("dp-run")
  request.addfinalizer(lambda: shutil.rmtree(src, ignore_errors=True))
  persistent = tmp_path_factory.mktemp("dp-persistent") / "ckpt"
  result, out = run_job(["save", "--steps", "11", "--layout", "dp", "--persistent-dir",
                         str(persistent), *TWO], 2, src)
  assert_ok(result, out)
  assert local_steps(src, 0) == local_steps(src, 1) == [8, 10], tail(out)
  return src, persistent


@pytest.fixture(scope="module")
def mixed_run(request, tmp_path_factory):
  """2 processes, each holding different shards (no twins): RAM {8, 10}, persistent
  {0, 4, 8}, each node's step held as a copy by the other."""
  return saved_run(request, tmp_path_factory, "mixed-run", TWO)


# ----------------------------------------------------------------------------- 2. mismatch


@pytest.mark.parametrize("with_persistent", [True, False], ids=["persistent", "ram-only"])
def test_a_target_with_another_mesh_layout_is_rebuilt_from_ram_bit_exact(
    mixed_run, root, tmp_path, with_persistent):
  """Same shapes, the mesh's device order reversed: every process's shards lie elsewhere than
  saved. Issue 27 made this an agreed error; the elastic restore (issue 31) now rebuilds the
  newest RAM step on the new layout, on every process, bit for bit."""
  persistent = clone_run(mixed_run, root, tmp_path)
  if not with_persistent:
    shutil.rmtree(persistent)
    persistent.mkdir()
  newest = max(local_steps(root, 0))
  kept = persistent_steps(persistent)
  result, out = run_job(["mismatch", "--persistent-dir", str(persistent), *TWO], 2, root)
  assert_ok(result, out)
  assert not raised(out), tail(out)
  assert_results(out, 2, step=newest, tier="elastic")
  assert newest in local_steps(root, 0) and newest in local_steps(root, 1)
  assert persistent_steps(persistent) == kept


# ----------------------------------------------------------------------------- 3. bad manifest


def _resign(raw: dict) -> dict:
  """The manifest with its own checksum made valid again (so the field checks see it)."""
  body = {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY}
  raw[MANIFEST_CRC_KEY] = manifest_checksum(body)
  return raw


def _corrupt(path: pathlib.Path, how: str) -> None:
  raw = json.loads(path.read_text())
  leaf = next(x for x in raw["items"]["state"]["leaves"] if x["shape"])
  if how == "null":
    path.write_text("null")
    return
  if how == "list":
    path.write_text("[1, 2, 3]")
    return
  if how == "float33":
    leaf["dtype"] = "float33"
  elif how == "shape":
    leaf["shape"] = [d + 1 for d in leaf["shape"]] or [2]
  elif how == "huge-size":
    raw["data_size"] = 1 << 60
  elif how == "index":
    leaf["shards"][0][0][0] = [0, 1 << 40]
  path.write_text(json.dumps(_resign(raw)))


@pytest.mark.parametrize("how", ["null", "float33", "huge-size", "index"])
def test_a_wrong_manifest_on_one_node_falls_back_to_the_twin_everywhere(
    dp_run, root, tmp_path, how):
  persistent = clone_run(dp_run, root, tmp_path)
  _corrupt(root / "node1" / "10" / MANIFEST, how)
  result, out = run_job(["restore", "--layout", "dp", "--persistent-dir", str(persistent),
                         *TWO], 2, root)
  assert_ok(result, out)
  got = results(out)
  assert sorted(got) == [0, 1], tail(out)
  # The twin still holds the newest step: that step is restored, bit for bit.
  assert {n: (f["step"], f["tier"], f["ok"]) for n, f in got.items()} == {
      0: ("10", "local", "1"), 1: ("10", "peer", "1")}, tail(out)
  assert verify_step(root / "node1" / "10").step == 10  # written back


def test_a_wrong_manifest_without_a_twin_falls_back_to_the_peer_copy(mixed_run, root, tmp_path):
  persistent = clone_run(mixed_run, root, tmp_path)
  _corrupt(root / "node1" / "10" / MANIFEST, "null")
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *TWO], 2, root)
  assert_ok(result, out)
  got = results(out)
  assert {n: (f["step"], f["tier"], f["ok"]) for n, f in got.items()} == {
      0: ("10", "local", "1"), 1: ("10", "peer", "1")}, tail(out)


# ----------------------------------------------------------------------------- 4. faults

# phase -> (fault step, whether a restore comes first, expected outcome)
#   "raise": every process raises the same CheckpointError naming process 1;
#   "continue": the job finishes (the fault is agreed and worked around everywhere).
FAULTS = {
    "write": (6, False, "raise"),
    "commit": (6, False, "raise"),
    "readback": (8, False, "continue"),
    "send": (6, False, "continue"),
    # A chunk that cannot be read or placed mid-transfer: zeros or a spare chunk go out, so
    # the receiver is never left inside the collective; the step's copies are dropped on
    # every process together after the transfer, and the job goes on.
    "chunk-read": (6, False, "continue"),
    "chunk-place": (6, False, "continue"),
    # The step's copy outgrew the size planned from the previous step's (no round agreed
    # it): not sent, dropped on every process after the transfer; the next step's copies
    # are sized again by the round.
    "outgrown": (6, False, "continue"),
    # Writing a received chunk fails on the receiver (its writer thread): that copy is not
    # kept there, and the agreed inventories plan restores without it; the job goes on.
    "receive": (6, False, "continue"),
    "restore-read": (None, True, "raise"),  # not proof of damage: raised, nothing dropped
    # Any error on a serving process before the exchange (not only a mismatch): agreed.
    "restore-plan": (None, True, "raise"),
    # RAM emptied: restored from the persistent tier, whose metadata read fails on one
    # process before Orbax's restore (and its barriers) starts.
    "persistent-read": (None, True, "raise"),
    "writeback": (None, True, "raise"),
}


@pytest.mark.parametrize("phase", sorted(FAULTS))
def test_a_fault_on_one_process_ends_the_same_way_on_every_process(
    mixed_run, root, tmp_path, phase):
  step, restore_first, outcome = FAULTS[phase]
  if restore_first:
    persistent = clone_run(mixed_run, root, tmp_path)
    if phase == "writeback":
      shutil.rmtree(root / "node1")  # node 1 recovers from its peer copy, then writes it back
    if phase == "persistent-read":
      for node in (0, 1):
        shutil.rmtree(root / f"node{node}")
  else:
    persistent = tmp_path / "persistent"
  command = ["fault", "--phase", phase, "--fault-process", "1", "--persistent-dir",
             str(persistent), "--steps", "16" if restore_first else "12", *TWO]
  if step is not None:
    command += ["--fault-step", str(step)]
  if restore_first:
    command += ["--restore-first"]
  result, out = run_job(command, 2, root, timeout_s=120)
  assert not result.timed_out, f"a process was left waiting: {result}\n{tail(out)}"
  errors = raised(out)
  if outcome == "raise":
    assert sorted(errors) == [0, 1], tail(out)
    messages = {f["detail"] for f in errors.values()}
    assert len(messages) == 1, messages  # the same error on every process
    (message,) = messages
    assert {f["type"] for f in errors.values()} == {"CheckpointError"}
    assert "process(es) [1]" in message and "injected" in message, message
    # Each exits 7 after printing; the launcher may kill the slower one as it exits.
    assert 7 in result.returncodes and 0 not in result.returncodes, result
  else:
    assert not errors and result.returncode == 0, tail(out)
    if phase.startswith("chunk-") or phase == "outgrown":
      dropped = "the peer copies of step 6 are dropped on every process"
      assert {n for n in (0, 1) if any(line.startswith(f"[node {n}]") and dropped in line
                                       for line in out.lines)} == {0, 1}, tail(out)
    if restore_first:
      got = results(out)
      assert {n: f["ok"] for n, f in got.items()} == {0: "1", 1: "1"}, tail(out)
      assert got[0]["step"] == got[1]["step"] == "10", tail(out)
      assert got[1]["tier"] == "peer", tail(out)  # its own read failed: the peer's copy
  # Nothing committed is lost, and a restart restores an agreed step bit for bit.
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *TWO], 2, root)
  assert_ok(result, out)
  got = results(out)
  assert sorted(got) == [0, 1] and got[0]["step"] == got[1]["step"], tail(out)
  assert all(f["ok"] == "1" for f in got.values()), tail(out)


def test_a_process_killed_mid_save_is_named_by_the_others_which_do_not_wait_forever(
    root, tmp_path):
  """SIGKILL of process 1 while it writes step 6: process 0 raises AgreementTimeoutError at
  its next agreement (bounded by agreement_timeout_seconds) instead of hanging in a
  collective; a restart restores the newest step both processes committed, bit for bit."""
  persistent = tmp_path / "persistent"
  command = ["fault", "--phase", "kill", "--fault-process", "1", "--fault-step", "6",
             "--persistent-dir", str(persistent), "--steps", "12", "--no-step-collective",
             *TWO[:-2], "--agreement-timeout", "10"]
  with started_job(command, 2, root) as (job, out):
    # Not job.wait(): the launcher would kill process 0 as soon as process 1 died.
    seen = out.wait_for(lambda lines: any("RAISED process=0" in line for line in lines), 120)
    assert seen, tail(out)
  errors = raised(out)
  assert list(errors) == [0], tail(out)
  assert errors[0]["type"] == "AgreementTimeoutError", errors[0]
  assert "not every process arrived within 10 s: process(es) [1] did not arrive" in \
      errors[0]["detail"], errors[0]
  assert local_steps(root, 1) == [2, 4]
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *TWO], 2, root)
  assert_ok(result, out)
  got = results(out)
  assert {n: (f["step"], f["ok"]) for n, f in got.items()} == {0: ("4", "1"), 1: ("4", "1")}, \
      tail(out)


# ----------------------------------------------------------------------------- 5. older step


def test_a_forced_save_of_an_older_step_leaves_ram_and_links_on_the_newest_step(root, tmp_path):
  """RAM 7, 8, 9 (max_to_keep=3): save(5, force=True) returns True and goes to the
  persistent tier only; every node's link still names 9, which exists; a restart restores 9."""
  persistent = tmp_path / "persistent"
  args = ["--local-interval", "1", "--local-keep", "3", "--persistent-interval", "1000",
          "--persistent-dir", str(persistent), *AGREE]
  result, out = run_job(["force-old", "--steps", "10", "--old-step", "5", *args], 2, root)
  assert_ok(result, out)
  forced = events(out, "FORCED")
  assert sorted(forced) == [0, 1], tail(out)
  for node, fields in forced.items():
    assert fields["saved"] == "1" and fields["all"] == "0,5,7,8,9", (node, fields)
    assert fields["links"] == "9->9/manifest.json", (node, fields)
    assert local_steps(root, node) == [7, 8, 9]
  assert persistent_steps(persistent) == [0, 5]
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *args], 2, root)
  assert_ok(result, out)
  assert {n: (f["step"], f["tier"], f["ok"]) for n, f in results(out).items()} == {
      0: ("9", "local", "1"), 1: ("9", "local", "1")}, tail(out)


# ----------------------------------------------------------------------------- 7. mirror mode


def test_mirror_mode_keeps_a_step_until_its_multi_chunk_copies_are_out(root, tmp_path):
  """Parent-style form mirroring the parent's one kept step into RAM, each node's step
  (about 4 MiB) sent to its peer in 1 MiB chunks: the parent's retention used to delete the
  previous step's folder while its copies were still being read. Every step's copies land,
  and a replaced node restores the newest step from its peer's copy, bit for bit."""
  persistent = tmp_path / "persistent"
  common = ["--persistent-dir", str(persistent), "--rows", "16384", *AGREE]
  result, out = run_job(["mirror", "--steps", "6", *common], 2, root, timeout_s=150)
  assert_ok(result, out)
  mirrored = events(out, "MIRROR")
  assert {n: f["all"] for n, f in mirrored.items()} == {0: "5", 1: "5"}, tail(out)
  assert {n: f["copies"] for n, f in mirrored.items()} == {0: "1:5", 1: "0:5"}, tail(out)
  shutil.rmtree(root / "node1")
  result, out = run_job(["mirror", "--steps", "7", "--restore-first", *common], 2, root,
                        timeout_s=150)
  assert_ok(result, out)
  got = results(out)
  assert {n: (f["step"], f["tier"], f["ok"]) for n, f in got.items()} == {
      0: ("5", "local", "1"), 1: ("5", "peer", "1")}, tail(out)


# ----------------------------------------------------------------------------- 6. lock


def test_two_processes_given_one_local_directory_fail_together(root, tmp_path):
  shared = root / "shared"
  result, out = run_job(["open", "--local-dir", str(shared), "--persistent-dir",
                         str(tmp_path / "persistent"), *TWO], 2, root, timeout_s=90)
  assert not result.timed_out, tail(out)
  errors = raised(out)
  assert sorted(errors) == [0, 1], tail(out)
  types = sorted(f["type"] for f in errors.values())
  assert types == ["CheckpointError", "LocalDirectoryInUseError"], errors
  for fields in errors.values():
    assert str(shared) in fields["detail"] and "own local directory" in fields["detail"], \
        fields["detail"]
  assert 7 in result.returncodes and 0 not in result.returncodes, result
