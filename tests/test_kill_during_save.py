"""SIGKILL at random moments of real saves, then a real restore: never a partial step.

One chain of launcher jobs per test (1 process x 2 devices; 2 processes x 2 devices without
and with peer replication, whose copies are then moving when the kill lands, and with each
step's copies spread over several saves, the saves between carrying them on). A
first job saves step 0 to both tiers uninterrupted. Each following job (`mp_worker chaos`)
restores whatever the previous one left, checks it bit for bit in every process against the
state recomputed for the restored step, then runs "training steps" (an all-reduce over every
shard) and saves after each one (local every step, 16 MiB of shards per process on the RAM
disk, keep 2; a persistent backup every 4 steps, keep 2) until the test SIGKILLs one of its
processes a seeded-random 0-40 ms after its seeded-random n-th "SAVING step=..." line. Saves
never stop, so the kill lands anywhere in a save's life: staging, the background write, between
data and manifest, around the commit rename, retention, a persistent backup. After each kill
the test checks, from the folders alone, that
  * every step `committed_steps` lists passes `verify_step` (checksums, sizes, its manifest
    names the step, process and process count),
  * no step was lost that a returned `save()` had already committed, and none appeared that
    was never saved,
and predicts what the next job must restore: the newest step every node committed, unless the
newest persistent step is newer. The next job's RESULT lines must show exactly that step and
tier, with bit-exact data in every process; a last job only restores, to check the last kill.
After about a third of the kills one node's RAM folder is also deleted (node replaced), which
forces the next restore onto the persistent tier (backups get SIGKILLed mid-write too), or,
with peers, onto the copies the other node holds: then the prediction is the newest step the
planner can assemble from the committed folders and copies on disk, every copy that can be
served must verify, and the replaced node must report tier "peer".

Set ORBAX_MTC_KILL_SEED to replay another sequence of kill points; run with -s to see them.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import sys
import time

import pytest
import warm_start
from mp_helpers import WORKER, child_env, mp_events, tail

from orbax_mtc import step_listing as restore_plan
from orbax_mtc.local.format import TMP_PREFIX, LocalTierError
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.tools import launch

LAUNCH_TIMEOUT_S = 90
SEED = int(os.environ.get("ORBAX_MTC_KILL_SEED", "20241122"))
ROWS = 65536  # params/w rows per process: 65536 x 64 float32 = 16 MiB of shards per process
CHAOS_ARGS = ["--rows", str(ROWS), "--seed", "3", "--local-interval", "1", "--local-keep", "2",
              "--persistent-interval", "4", "--persistent-keep", "2"]



def _steps_of(out, kind: str, node: int) -> list[int]:
  return [int(f["step"]) for n, f in mp_events.events(out.lines, kind) if n == node]


def expected_restore(root: pathlib.Path, nprocs: int, persistent: pathlib.Path, peers: bool):
  """(step, tier per node) the next job must restore, predicted from the folders alone.

  With peers, the newest step the planner can assemble from the committed own folders and
  complete copies found on disk (each process holds different shards here: no twins).
  """
  if peers:
    backups = [int(p.name) for p in persistent.iterdir() if p.name.isdigit()] \
        if persistent.is_dir() else []
    inventories = []
    for n in range(nprocs):
      own = committed_steps(root / f"node{n}")
      copies = peer_store.PeerStore(root / f"node{n}", max_to_keep=None).servable(own)
      inventories.append(restore_plan.NodeInventory(frozenset(own), frozenset(copies)))
    plan = restore_plan.plan_restore(inventories, backups, None)
    if plan.candidates:
      first = plan.candidates[0]
      return first.step, tuple("local" if s.kind == restore_plan.OWN else "peer"
                               for s in first.sources)
    if plan.persistent_step is not None:
      return plan.persistent_step, ("persistent",) * nprocs
    return None, ("none",) * nprocs
  common = set.intersection(*(set(committed_steps(root / f"node{n}"))
                              for n in range(nprocs)))
  backups = [int(p.name) for p in persistent.iterdir() if p.name.isdigit()] \
      if persistent.is_dir() else []
  newest_local = max(common, default=None)
  newest_backup = max(backups, default=None)
  if newest_local is not None and (newest_backup is None or newest_local >= newest_backup):
    return newest_local, ("local",) * nprocs
  if newest_backup is not None:
    return newest_backup, ("persistent",) * nprocs
  return None, ("none",) * nprocs


def check_results(out, nprocs: int, expected) -> None:
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == list(range(nprocs)), f"missing RESULT lines:\n{tail(out)}"
  for node, fields in results.items():
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
    assert (fields["step"], fields["tier"]) == (str(expected[0]), expected[1][node]), (
        f"node {node} restored step {fields['step']} from {fields['tier']}, expected step "
        f"{expected[0]} from {expected[1][node]}\n{tail(out)}")
    # Orbax's resume by number finds it too, and nothing newer stays listed after.
    assert (fields["listed"], fields["after"]) == (str(expected[0]),) * 2, (
        f"node {node}: latest_step() was {fields['listed']} before restoring step "
        f"{expected[0]}, {fields['after']} after\n{tail(out)}")


def node_steps(root: pathlib.Path, nprocs: int) -> list[list[int]]:
  return [committed_steps(root / f"node{n}") for n in range(nprocs)]


def check_folders_after_kill(root: pathlib.Path, nprocs: int, out, restored: int | None):
  """Committed steps verify; none lost that a returned save() committed; none invented."""
  start = -1 if restored is None else restored
  for node in range(nprocs):
    node_dir = root / f"node{node}"
    steps = committed_steps(node_dir)
    for step in steps:
      try:
        manifest = verify_step(node_dir / str(step))
      except LocalTierError as e:
        pytest.fail(f"node {node}: committed step {step} does not verify: {e}")
      assert (manifest.step, manifest.process_index, manifest.process_count) == (
          step, node, nprocs)
    store = peer_store.PeerStore(node_dir, max_to_keep=None)
    for source, step in store.servable(steps):
      try:
        store.read(source, step, node_dir / str(step))
      except LocalTierError as e:
        pytest.fail(f"node {node}: committed copy of node {source} step {step} is bad: {e}")
    saving = _steps_of(out, "SAVING", node)
    saved = _steps_of(out, "SAVED", node)
    newest = max(steps, default=None)
    # Never a step that was not being saved (older timelines were dropped by the restore).
    assert newest is None or newest <= max(saving + [start]), (
        f"node {node} holds steps {steps} but only started saving {saving} (restored "
        f"{restored})")
    # save(k) returns only after the write of k-1 committed (one write in flight at a time).
    if saved and saved[-1] - 1 > start:
      assert newest is not None and newest >= saved[-1] - 1, (
          f"node {node}: save({saved[-1]}) returned, so step {saved[-1] - 1} was committed, "
          f"but the folder holds {steps}")


def run_chain(nprocs: int, kills: int, root: pathlib.Path, logs: pathlib.Path,
              peers: bool, extra: tuple[str, ...] = (), saves: tuple[int, int] = (1, 6)
              ) -> list[str]:
  """`kills` jobs, each SIGKILLed at a random point, then a last restore; returns a summary."""
  rng = random.Random(f"{SEED}-{nprocs}-{peers}{'-' if extra else ''}{'-'.join(extra)}")
  persistent = logs / "persistent"
  command = [sys.executable, str(WORKER), "chaos", "--persistent-dir", str(persistent),
             *CHAOS_ARGS, *([] if peers else ["--peers-per-node", "0"]), *extra]
  # A first uninterrupted job commits step 0 in both tiers, so that every later restore finds
  # something: a restore that finds nothing leaves abandoned local steps behind (a known bug,
  # see test_multiprocess.test_restart_from_scratch_drops_abandoned_local_steps), which this
  # chain would otherwise trip over at random.
  out = mp_events.LineCollector()
  result = launch.run_processes([*command[:2], "save", *command[3:], "--steps", "1"], nprocs,
                                devices_per_process=2, local_root=root, env=child_env(),
                                output=out, timeout_s=LAUNCH_TIMEOUT_S)
  assert result.returncode == 0, f"{result}\n{tail(out)}"
  expected = expected_restore(root, nprocs, persistent, peers)
  assert expected == (0, ("local",) * nprocs), (expected, tail(out))
  summary = []
  tiers = []
  half_written = half_written_backups = 0  # kills that left a half-written step behind
  victims = [i % nprocs for i in range(kills + 1)]  # every process gets killed
  rng.shuffle(victims)
  # After some kills a node is also replaced, which forces a restore from the persistent tier
  # (backups are SIGKILLed mid-write too).
  replace_node = [i % 3 == 2 for i in range(kills + 1)]
  rng.shuffle(replace_node)
  for iteration in range(kills + 1):
    last = iteration == kills
    victim = victims[iteration]
    saves_before_kill = rng.randint(*saves)
    if peers and replace_node[iteration]:
      # A replaced node restores from its peer's copies only if some step's copies had
      # landed before the kill, a save or two after the step: such kills come later in the
      # job (otherwise a seed whose replacements all follow early kills never restores
      # from a peer, as ORBAX_MTC_KILL_SEED=1128 did).
      saves_before_kill = max(saves_before_kill, sum(saves) // 2 + 1)
    delay_s = rng.uniform(0.0, 0.04)
    out = mp_events.LineCollector()
    log_file = logs / f"job{iteration}.log"
    with warm_start.WarmJob(command if not last else [*command[:2], "restore", *command[3:]],
                            nprocs, devices_per_process=2, local_root=root, env=child_env(),
                            output=out) as job:
      job.start()
      if last:
        seen = True
      else:
        seen = out.wait_for(
            lambda lines, v=victim, k=saves_before_kill: sum(
                1 for n, _ in mp_events.events(lines, "SAVING") if n == v) >= k,
            timeout_s=LAUNCH_TIMEOUT_S)
        if seen:
          time.sleep(delay_s)  # the random kill point, not a synchronisation
          os.kill(job.pids[victim], signal.SIGKILL)
      result = job.wait(timeout_s=LAUNCH_TIMEOUT_S)
    log_file.write_text(out.text())
    context = "\n".join([*summary, f"job {iteration} ({log_file}): {result}", tail(out)])
    assert seen, f"no SAVING line in {context}"
    check_results(out, nprocs, expected)
    if last:
      assert result.returncode == 0, context
      break
    assert result.returncodes[victim] == 137 and not result.timed_out, context
    restored = expected[0]
    try:
      check_folders_after_kill(root, nprocs, out, restored)
    except AssertionError as e:
      raise AssertionError(f"{e}\n{context}") from None
    half_written += any(e.name.startswith(TMP_PREFIX)
                        for n in range(nprocs) for e in (root / f"node{n}").iterdir())
    half_written_backups += persistent.is_dir() and any(
        not p.name.isdigit() for p in persistent.iterdir())
    replaced = None
    if replace_node[iteration]:  # the node is replaced: its RAM disk comes back empty
      replaced = rng.randrange(nprocs)
      shutil.rmtree(root / f"node{replaced}")
    expected = expected_restore(root, nprocs, persistent, peers)
    tiers.extend(expected[1])
    backups = sorted(int(p.name) for p in persistent.iterdir() if p.name.isdigit()) \
        if persistent.is_dir() else []
    summary.append(
        f"kill {iteration}: node {victim} {delay_s * 1000:.0f} ms after its SAVING line "
        f"#{saves_before_kill}; last SAVING per node "
        f"{[(_steps_of(out, 'SAVING', n) or [None])[-1] for n in range(nprocs)]}; committed "
        f"{node_steps(root, nprocs)}, persistent {backups}"
        f"{'' if replaced is None else f', node {replaced} replaced'} -> restore {expected}")
  summary.append(f"kills that left a half-written step: local {half_written}, persistent "
                 f"{half_written_backups}")
  # The chain exercised the tiers it should: node replacements force persistent restores
  # without peers, and recoveries from a peer's copy with them.
  wanted = {"local", "peer"} if peers else {"local", "persistent"}
  assert wanted <= set(tiers), "\n".join(summary)
  return summary


# Each step's copies spread over several saves (1 MiB chunks, 8 a save, past the next save:
# the saves between carry them on, as on a link that lags them), so kills land while a step
# older than the newest is being sent and its folder must outlive the newer saves. Backups
# every 48 steps, so that the copies, a few steps behind, are what a replaced node restores.
SPREAD = ("--chunk-mib", "1", "--call-mib", "8", "--stretch", "3", "--persistent-interval",
          "48")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs,kills,peers,extra", [
    (1, 10, False, ()), (2, 8, False, ()), (2, 8, True, ()), (2, 10, True, SPREAD)],
    ids=["1proc", "2proc", "2proc-peers", "2proc-peers-spread"])
def test_sigkill_at_random_points_of_saves(nprocs, kills, peers, extra, shm_root, tmp_path):
  # Spread copies land a few saves after their step: jobs run a few saves longer.
  summary = run_chain(nprocs, kills, shm_root, tmp_path, peers, extra,
                      saves=(3, 9) if extra else (1, 6))
  print("\n".join(summary))
