"""Multi-process tests: real JAX processes joined by `jax.distributed` on localhost.

Every job is started with our launcher (`orbax_mtc.tools.launch`), 2 processes x 2 CPU devices (one
test: 4 x 1), each process with its own folder under /dev/shm. The child is `tests/mp_worker`:
it builds a mesh (data, model) = (processes, devices per process), so the "data" axis spans
processes and each process holds different shards, saves a mixed-dtype state (float32, bfloat16,
int32, scalars; nested) that is a pure function of (seed, step), and after a restore compares
its own shards bit for bit (and dtype, shape, sharding) with the state recomputed for the
restored step, printing `@@mtc RESULT process=i step=S tier=T ok=1`.

Covered: round trip from RAM; restart after a SIGKILL that left nodes with different steps;
all RAM folders wiped; one node replaced; a corrupt shard on one node; the persistent tier read
by plain Orbax in one process with one device; 4 processes x 1 device. Three tests guard fixes
for bugs found here (retention keeps the newest step every node holds; a restore that finds
nothing drops abandoned local steps; a forced re-save of a step only some nodes hold is refused
on every node instead of desynchronising the collectives).

Wall time on a 2-core machine: about 45 s.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import mp_helpers
import pytest
from mp_helpers import (
  WORKER,
  assert_ok,
  assert_results,
  child_env,
  mp_events,
  new_root,
  run_job,
  tail,
)

from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local.format import DATA, CorruptStepError
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps, read_manifest
from orbax_mtc.tools import launch

# run_job's own 90 s limit makes a hang show as a failed launch, well before this fires.
pytestmark = pytest.mark.timeout(240)

# The schedule of the shared run: local every 2 steps (keep 2), persistent every 4.
SAVE_ARGS = ["--local-interval", "2", "--local-keep", "2", "--persistent-interval", "4"]


def committed(out) -> dict[int, dict[str, str]]:
  return {node: fields for node, fields in mp_events.events(out.lines, "COMMITTED")}


def persistent_steps(directory: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def verified_steps(node_dir: pathlib.Path) -> list[int]:
  """committed_steps of a node folder, each of which must pass verify_step."""
  steps = committed_steps(node_dir)
  for step in steps:
    manifest = verify_step(node_dir / str(step))
    assert manifest.step == step
  return steps


def lkg_problems(node_dir: pathlib.Path) -> list[str]:
  """LKG links of a node folder that do not name and point at its newest committed step."""
  steps = committed_steps(node_dir)
  problems = []
  for entry in lkg.list_entries(node_dir):
    link = node_dir / entry.name
    target = os.readlink(link) if link.is_symlink() else None
    folder = None if target is None else target.removesuffix("/manifest.json")
    if folder is None or not folder.isdigit() or int(folder) not in steps:
      problems.append(f"{entry.name} -> {target}: not a committed step (committed: {steps})")
    elif not steps or entry.step != steps[-1] or int(folder) != steps[-1]:
      problems.append(f"{entry.name} -> {target}: newest committed step is {steps[-1]}")
  return problems


# ----------------------------------------------------------------------------- shared run


@pytest.fixture(scope="module")
def saved_run(request, tmp_path_factory):
  """One 2x2 job saving steps 0..10: local {8, 10} on each node, persistent {0, 4, 8}.

  Tests restore from copies (`clone`), so each sees the pristine folders.
  """
  root = new_root("saved")
  request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
  persistent = tmp_path_factory.mktemp("saved-persistent") / "ckpt"
  result, out = run_job(["save", "--steps", "11", "--persistent-dir", str(persistent),
                         *SAVE_ARGS], 2, root)
  assert_ok(result, out)
  for node in (0, 1):
    assert committed(out)[node]["local"] == "8,10", tail(out)
    assert committed(out)[node]["persistent"] == "0,4,8", tail(out)
  return root, persistent


def clone(saved_run, root: pathlib.Path, tmp_path: pathlib.Path, nodes=(0, 1)):
  """Copies the shared run's node folders `nodes` (others left empty) and persistent dir."""
  src_root, src_persistent = saved_run
  for node in (0, 1):
    dst = root / f"node{node}"
    if node in nodes:
      shutil.copytree(src_root / f"node{node}", dst, symlinks=True)
    else:
      dst.mkdir(parents=True)
  persistent = tmp_path / "persistent"
  shutil.copytree(src_persistent, persistent, symlinks=True)
  return persistent


def test_round_trip_restores_newest_local_step_bit_exact(saved_run, shm_root, tmp_path):
  persistent = clone(saved_run, shm_root, tmp_path)
  for node in (0, 1):
    node_dir = shm_root / f"node{node}"
    assert verified_steps(node_dir) == [8, 10]
    manifest = read_manifest(node_dir / "10")
    assert (manifest.process_index, manifest.process_count) == (node, 2)
    assert not lkg_problems(node_dir)
  # Each process wrote only its own shards: the "data" axis splits params/w between them.
  shards = [{s.index for leaf in read_manifest(shm_root / f"node{n}" / "10")
             .items["state"].leaves if leaf.path == "['params']['w']" for s in leaf.shards}
            for n in (0, 1)]
  assert shards[0] and shards[1] and not shards[0] & shards[1]

  result, out = run_job(["restore", "--persistent-dir", str(persistent), "--expect-step", "10",
                         "--expect-tier", "local"], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=10, tier="local")


def test_all_local_folders_wiped_restores_newest_persistent_step(saved_run, shm_root, tmp_path):
  persistent = clone(saved_run, shm_root, tmp_path, nodes=())
  assert persistent_steps(persistent) == [0, 4, 8]
  result, out = run_job(["restore", "--persistent-dir", str(persistent), "--explicit-args",
                         "--expect-step", "8", "--expect-tier", "persistent"], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=8, tier="persistent")


def test_replaced_node_recovers_from_its_peer_at_newest_step(saved_run, shm_root, tmp_path):
  # Node 1 was replaced: its RAM disk is empty. Node 0 holds its own steps and a copy of node
  # 1's, so both resume at step 10 from RAM and node 1 gets its folder back.
  persistent = clone(saved_run, shm_root, tmp_path, nodes=(0,))
  result, out = run_job(["restore", "--persistent-dir", str(persistent)], 2, shm_root)
  assert_ok(result, out)
  results = mp_events.parse_results(out.lines)
  assert [(results[n]["step"], results[n]["tier"], results[n]["ok"]) for n in (0, 1)] == [
      ("10", "local", "1"), ("10", "peer", "1")], tail(out)
  assert verified_steps(shm_root / "node1") == [10]
  assert not lkg_problems(shm_root / "node1")


def test_replaced_node_without_peers_makes_every_process_agree_on_persistent_step(
    saved_run, shm_root, tmp_path):
  # With replication off, a step only one process holds cannot be assembled, so both must
  # take persistent step 8.
  persistent = clone(saved_run, shm_root, tmp_path, nodes=(0,))
  result, out = run_job(["restore", "--persistent-dir", str(persistent), "--peers-per-node",
                         "0"], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=8, tier="persistent")
  # Node 0's step 10 belongs to an abandoned timeline and is dropped; step 8 stays.
  assert verified_steps(shm_root / "node0") == [8]


def test_corrupt_shard_on_one_node_is_replaced_by_its_peer_copy(saved_run, shm_root, tmp_path):
  # One flipped bit in node 1's own step 10: its checksum fails there only; node 1 takes step
  # 10 from the copy node 0 holds, and its folder is rewritten with good bytes.
  persistent = clone(saved_run, shm_root, tmp_path)
  data = shm_root / "node1" / "10" / DATA
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 3] ^= 0x01
  data.write_bytes(bytes(raw))
  with pytest.raises(CorruptStepError):
    verify_step(shm_root / "node1" / "10")
  result, out = run_job(["restore", "--persistent-dir", str(persistent)], 2, shm_root)
  assert_ok(result, out)
  results = mp_events.parse_results(out.lines)
  assert [(results[n]["step"], results[n]["tier"], results[n]["ok"]) for n in (0, 1)] == [
      ("10", "local", "1"), ("10", "peer", "1")], tail(out)
  assert 10 in verified_steps(shm_root / "node1")


def test_corrupt_shard_without_peers_makes_every_process_fall_back_to_older_step(
    saved_run, shm_root, tmp_path):
  # Without copies, both processes must agree on the next step they all hold (8), not mix
  # 10 and 8.
  persistent = clone(saved_run, shm_root, tmp_path)
  data = shm_root / "node1" / "10" / DATA
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 3] ^= 0x01
  data.write_bytes(bytes(raw))
  result, out = run_job(["restore", "--persistent-dir", str(persistent), "--peers-per-node",
                         "0"], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=8, tier="local")


def test_persistent_checkpoint_restores_in_one_process_with_one_device(saved_run, tmp_path):
  persistent = tmp_path / "persistent"
  shutil.copytree(saved_run[1], persistent, symlinks=True)
  env = {k: v for k, v in os.environ.items() if not k.startswith("ORBAX_MTC_")}
  env.update(child_env(), JAX_PLATFORMS="cpu",
             XLA_FLAGS=launch.merge_xla_flags(env.get("XLA_FLAGS"), 1))
  proc = subprocess.run(
      [sys.executable, str(WORKER), "plain-restore", "--persistent-dir", str(persistent),
       "--step", "8", "--data", "2", "--model", "2"],
      env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
  output = proc.stdout + proc.stderr
  results = [fields for _, fields in mp_events.events(proc.stdout.splitlines(), "RESULT")]
  assert proc.returncode == 0, output[-4000:]
  assert [r["mode"] for r in results] == ["numpy", "device"], output[-4000:]
  for fields in results:
    assert (fields["devices"], fields["step"]) == ("1", "8"), fields
    assert fields["ok"] == "1", f"{fields['mode']}: {fields['detail']}"


# ----------------------------------------------------------------------------- SIGKILL


@pytest.fixture(scope="module")
def crashed_run(request, tmp_path_factory):
  """A 2x2 job in which process 1 is SIGKILLed at step 8, then a restarted job.

  Schedule: local every 2 steps (keep 2), persistent every 5. At step 8 process 0 commits step
  8 locally and process 1 does not, then process 1 kills itself: node 0 holds {6, 8}, node 1
  {4, 6}, persistent {0, 5}. The newest step both committed is 6.
  """
  root = new_root("crashed")
  request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
  persistent = tmp_path_factory.mktemp("crashed-persistent") / "ckpt"
  args = ["--persistent-dir", str(persistent), "--local-interval", "2", "--local-keep", "2",
          "--persistent-interval", "5"]
  crash, crash_out = run_job(["save", "--steps", "20", "--die-at-step", "8",
                              "--die-process", "1", *args], 2, root)
  before = {node: verified_steps(root / f"node{node}") for node in (0, 1)}
  before_persistent = persistent_steps(persistent)
  restart, restart_out = run_job(["restore", *args], 2, root)
  return dict(root=root, crash=crash, crash_out=crash_out, before=before,
              before_persistent=before_persistent, restart=restart, restart_out=restart_out)


def test_restart_after_sigkill_restores_newest_step_every_process_committed(crashed_run):
  crash, out = crashed_run["crash"], crashed_run["crash_out"]
  assert mp_events.events(out.lines, "DYING") == [(1, {"process": "1", "step": "8"})], tail(out)
  # The launcher reports the death by SIGKILL (128+9) and killed the sibling.
  assert crash.returncode == 137 and crash.returncodes == [137, 137], (crash, tail(out))
  assert not crash.timed_out
  # Step 5 is a backup step, so it was saved to RAM too (backups are taken from there).
  # Node 0 also keeps 5 while step 6's copies have not landed (they land at the save after
  # the one that issued them: whether that was step 7's call or step 8's depends on when
  # step 6's writes ended), so that a replaced node still finds a step its peers complete.
  before = crashed_run["before"]
  assert before[0] in ([6, 8], [5, 6, 8]) and before[1] == [5, 6], before
  assert crashed_run["before_persistent"] == [0, 5]

  restart, restart_out = crashed_run["restart"], crashed_run["restart_out"]
  assert_ok(restart, restart_out)
  assert_results(restart_out, 2, step=6, tier="local")
  # Step 8, which only node 0 holds, is dropped: a later save of step 8 must not meet it.
  root = crashed_run["root"]
  after = verified_steps(root / "node0")
  assert after[-1:] == [6] and set(after) <= {5, 6}, after
  assert verified_steps(root / "node1") == [5, 6]


def test_lkg_link_follows_restore_rollback(crashed_run):
  """After the restart rolled node 0 back from step 8 to 6, its LKG link must name step 6.

  (Regression: the link `orbax-s8-n0-w0.restore -> 8` used to stay, dangling, until the next
  local commit; a GKE-style reader or `status` would be told to restore a deleted step.)
  """
  root = crashed_run["root"]
  assert crashed_run["before"][0][-2:] == [6, 8]
  assert_ok(crashed_run["restart"], crashed_run["restart_out"])
  problems = lkg_problems(root / "node0") + lkg_problems(root / "node1")
  assert not problems, problems


def test_crash_between_nodes_commits_keeps_a_common_ram_step_with_max_to_keep_1(
    shm_root, tmp_path):
  """With the default max_to_keep=1, a crash while step 8 is committed on some nodes only must
  still leave step 6 restorable from RAM.

  Process 0 commits step 8 (and retires 6), process 1 is killed before committing 8: node 0
  holds {8}, node 1 holds {6}; no step is in every node's RAM and the job falls back to
  persistent step 5, losing the RAM tier exactly in the failure it exists for. Retention should
  keep the newest step every process has committed until a newer one is committed everywhere.
  """
  args = ["--persistent-dir", str(tmp_path / "persistent"), "--local-interval", "2",
          "--local-keep", "1", "--persistent-interval", "5"]
  crash, out = run_job(["save", "--steps", "20", "--die-at-step", "8", "--die-process", "1",
                        *args], 2, shm_root)
  assert crash.returncodes[1] == 137, (crash, tail(out))
  # Node 1 never committed 8; it still holds 6, the newest step both nodes had committed.
  assert verified_steps(shm_root / "node1")[-1] == 6
  result, out = run_job(["restore", *args], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=6, tier="local")


def test_resuming_from_latest_step_drops_a_step_one_node_alone_committed(shm_root, tmp_path):
  """`mgr.restore(mgr.latest_step())` (Orbax's and MaxText's resume) after node 0 committed
  step 5 and node 1 died before committing it: the listing says 4, the job restores 4 and
  saves 5 again. Node 0's step 5 is a leftover of the abandoned timeline: kept, that save
  raised StepAlreadyExistsError, at every restart."""
  args = ["--persistent-dir", str(tmp_path / "persistent"), "--local-interval", "1",
          "--local-keep", "3", "--persistent-interval", "100", "--peers-per-node", "0"]
  crash, out = run_job(["save", "--steps", "9", "--die-at-step", "5", "--die-process", "1",
                        *args], 2, shm_root)
  assert crash.returncodes[1] == 137, (crash, tail(out))
  assert [verified_steps(shm_root / f"node{n}")[-1] for n in (0, 1)] == [5, 4]
  result, out = run_job(["save", "--restore-first", "--resume-latest", "--steps", "8",
                         "--expect-step", "4", "--expect-tier", "local", *args], 2, shm_root)
  assert_ok(result, out)
  result, out = run_job(["restore", *args], 2, shm_root)
  assert_results(out, 2, step=7, tier="local")


@pytest.mark.parametrize("node1", ["lacks-5", "replaced"])
def test_parent_style_resume_over_a_step_one_node_alone_committed(node1, shm_root, tmp_path):
  """The same leftover under the parent-style form (`ocp.CheckpointManager`'s constructor
  plus a RAM tier), restored from RAM or (node 1 replaced, no copies) by the parent: its next
  save of step 5 failed on node 0 ("already committed"), on every process, at every
  restart. Node 0's old step 5 is now dropped by the restore, whichever tier served it (and
  set aside at the new one's commit where no restore ran)."""
  persistent = tmp_path / "persistent"
  args = ["--persistent-dir", str(persistent)]
  result, out = run_job(["parent-resume", "--steps", "6", *args], 2, shm_root)
  assert_ok(result, out)
  # As a kill leaves them: node 1 died before committing step 5, and so did Orbax's step 5.
  lost = [shm_root / "node1" / "5", *shm_root.glob("node*/peers/*/5")]
  if node1 == "replaced":
    lost = [shm_root / "node1", shm_root / "node0" / "peers"]
  for folder in (persistent / "5", *lost):
    shutil.rmtree(folder)
  assert verified_steps(shm_root / "node0")[-1] == 5
  first = ("persistent" if node1 == "replaced" else "local")
  for restored, tier, stop in ((4, first, 6), (5, "local", 8)):
    result, out = run_job(["parent-resume", "--steps", str(stop), *args], 2, shm_root)
    assert_ok(result, out)
    assert_results(out, 2, step=restored, tier=tier)
    # Dropped by the restore (its copies too), not only set aside by the save after it.
    assert not list(shm_root.glob("node*/.damaged-*")), sorted(shm_root.glob("node*/.*"))




def test_a_mesh_the_user_set_does_not_stop_the_collectives(shm_root, tmp_path):
  """`jax.set_mesh(mesh)` (explicit sharding, here as a global setter) before the manager:
  its collectives run jitted shard_maps over a mesh of their own, and JAX raised ValueError
  ("The context mesh ... should match the mesh passed to shard_map") at the first one. Saves
  with peer copies, then node 1 replaced: restored from its peer's copy, bit for bit."""
  args = ["--persistent-dir", str(tmp_path / "persistent"), "--persistent-interval", "100",
          "--set-mesh"]
  result, out = run_job(["save", "--steps", "6", *args], 2, shm_root)
  assert_ok(result, out)
  shutil.rmtree(shm_root / "node1")
  result, out = run_job(["restore", *args], 2, shm_root)
  assert_ok(result, out)
  results = mp_events.parse_results(out.lines)
  assert [(results[n]["step"], results[n]["tier"], results[n]["ok"]) for n in (0, 1)] == [
      ("4", "local", "1"), ("4", "peer", "1")], tail(out)

def test_restart_from_scratch_drops_abandoned_local_steps(shm_root, tmp_path):
  """A restart that restores nothing must not keep (or later restore) the old local steps.

  Run A (seed 1) commits steps 8, 9 on both nodes. Node 1 is replaced and the first backup
  never completed, so run B finds nothing to restore and starts from scratch (seed 2: a new
  timeline). B saves steps 0..9. Expected: both nodes hold B's steps 8, 9; a restart restores
  B's step 9 bit for bit. Found by these tests: `restore()` drops abandoned local steps only
  when it restored something (`_finish_restore`), so node 0 keeps A's steps 8, 9,
  `_local_should_save` skips every step <= 9 on node 0 (no RAM copy of B at all there), and
  the restart restores step 9 from A's shards on node 0 and B's on node 1.
  """
  # Without peers: with them node 0's copy of node 1's step 9 would (rightly) be restored.
  args = ["--local-interval", "1", "--local-keep", "2", "--persistent-interval", "1000",
          "--peers-per-node", "0"]
  persistent_a = tmp_path / "persistent-a"
  result, out = run_job(["save", "--steps", "10", "--seed", "1", "--persistent-dir",
                         str(persistent_a), *args], 2, shm_root)
  assert_ok(result, out)
  assert verified_steps(shm_root / "node0") == [8, 9]
  shutil.rmtree(shm_root / "node1")
  persistent_b = tmp_path / "persistent-b"  # run A's backup never completed
  b_args = ["--seed", "2", "--persistent-dir", str(persistent_b), *args]
  result, out = run_job(["save", "--restore-first", "--steps", "10", *b_args], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=None, tier="none")
  # The restart must not hand back run A's shards on node 0 as step 9.
  result, out = run_job(["restore", *b_args], 2, shm_root)
  assert_results(out, 2, step=9, tier="local")
  assert_ok(result, out)


def test_forced_resave_takes_the_same_branch_on_every_process(shm_root, tmp_path):
  """save(step, force=True) of a step that only some processes hold in RAM raises
  StepAlreadyExistsError on every process, naming the holders (it used to back the step up on
  those and wait in the save's all-gather on the others: a hang); a step every process holds
  is backed up from RAM on all of them."""
  args = ["--local-interval", "1", "--local-keep", "3", "--persistent-interval", "1000",
          "--peers-per-node", "0", "--persistent-dir", str(tmp_path / "persistent")]
  result, out = run_job(["resave", "--steps", "6", "--drop-process", "1", *args], 2, shm_root)
  assert_ok(result, out)
  outcomes = {(node, f["step"]): f["detail"] for node, f in mp_events.events(out.lines, "RESAVE")}
  for node in (0, 1):
    assert outcomes[(node, "5")].startswith("StepAlreadyExistsError"), tail(out)
    assert "process(es) [0] only" in outcomes[(node, "5")], outcomes
    assert outcomes[(node, "4")] == "saved=1", outcomes
  persistent = {node: f["steps"] for node, f in mp_events.events(out.lines, "PERSISTENT")}
  assert persistent == {0: "0,4", 1: "0,4"}, tail(out)


# ----------------------------------------------------------------------------- 4 x 1


def test_four_processes_one_device_each_round_trip(shm_root, tmp_path):
  persistent = tmp_path / "persistent"
  args = ["--persistent-dir", str(persistent), "--seed", "7", *SAVE_ARGS]
  result, out = run_job(["save", "--steps", "7", *args], 4, shm_root, devices=1)
  assert_ok(result, out)
  for node in range(4):
    assert verified_steps(shm_root / f"node{node}") == [4, 6]
  assert persistent_steps(persistent) == [0, 4]

  result, out = run_job(["restore", "--expect-step", "6", "--expect-tier", "local", *args], 4,
                        shm_root, devices=1)
  assert_ok(result, out)
  assert_results(out, 4, step=6, tier="local")


def test_a_worker_still_running_prints_where_every_thread_waits(shm_root, tmp_path):
  """The harness's stack dump (mp_helpers.STACKS_AFTER_S, here 0.5 s): a job that runs past
  it prints every thread's stack into its output once, so a job killed at its timeout shows
  where each process waited; it goes on and ends as usual."""
  result, out = run_job(["save", "--steps", "2", "--persistent-dir", str(tmp_path / "p")], 2,
                        shm_root, env={"MTC_TEST_STACKS_AFTER_S": "0.5"})
  assert_ok(result, out)
  for node in (0, 1):
    assert any(line.startswith(f"[node {node}] ") and "most recent call first" in line
               for line in out.lines), tail(out)
  # A failure message keeps the printed lines and, apart, the stacks of threads not idle
  # (each main thread runs the worker's module).
  printed, stacks = tail(out).split("\n--- stacks ---\n")
  assert "most recent call first" not in printed, printed
  for node in (0, 1):
    assert f'[node {node}]   File "{WORKER}' in stacks, stacks
    # And how many train steps it had run, twice (a loop that runs on vs a process that waits).
    assert sum(line.startswith(f"[node {node}] @@mtc PROGRESS train_steps=")
               for line in out.lines) == 2, printed


def test_a_line_printed_in_the_middle_of_a_dump_cuts_no_stack():
  """Another thread's line printed while faulthandler dumps a node's stacks (its own node's
  or another's) goes with the output; the node's stack goes on to its last frame."""
  lines = ['[node 1] Thread 0x01 (most recent call first):',
           '[node 1]   File "/x/orbax_mtc/transport.py", line 1 in _retire',
           '[node 1] W1128 transfer: a warning from another thread',
           '[node 0] @@mtc PROGRESS train_steps=3',
           '[node 1]   File "/x/tests/mp_worker/__main__.py", line 2 in main',
           '[node 1] ',
           '[node 1] @@mtc PROGRESS train_steps=4']
  others, stacks = mp_helpers._stacks_apart(lines)  # noqa: SLF001 - the parser itself
  assert stacks == [lines[0], lines[1], lines[4]], stacks
  assert others == [lines[2], lines[3], lines[6]], others
