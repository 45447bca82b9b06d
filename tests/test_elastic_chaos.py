"""A randomized fault campaign across host counts: SIGKILL or SIGTERM, lost RAM, other layouts.

One chain of jobs on one set of RAM folders and one persistent folder (a local folder, or
gs:// on a real GCS JSON-API server on loopback: one chain each). Each job runs on a layout
drawn at random (1 process x 2 devices, 2 x 1, 2 x 2 or 4 x 1; always two data replicas, and
state shapes that follow a (data=2, model=2) mesh whatever the job's mesh, so every job's
state is every other job's on another layout), restores whatever the jobs before it left
(half of the jobs with `restore(None)`, half with `restore(latest_step())`, Orbax's and
MaxText's resume, which must give the same step; either way `latest_step()` must name it
before and after), checks it bit for bit in every process against the state recomputed for
that step, then saves every step (RAM every step, keep 2; persistent every 4, keep 2) until
the test ends it: half of the jobs with a SIGKILL to one process a seeded-random 0-40 ms
after its seeded-random n-th "SAVING" line (3 times in 10, 0-300 ms after it began saving a step the
persistent tier takes, so that backups are cut too), a quarter with a SIGKILL 0-1 s after
the job started or 0-30 ms after the process's restore returned (in its start, its restore,
the restore's write-back or its first saves), a quarter with a SIGTERM to one process once
all train (every process must save the one step they agree on and exit cleanly, as under
`exit_after_ondemand_checkpoint`). After a third of the jobs one node's RAM folder is
deleted (node replaced), after a sixth two nodes' folders are exchanged (the processes
restart with permuted ids). A shrunk job cannot reach the folders of the ranks it no longer
has; a grown one finds empty or older folders there.

Before each job the test predicts, from the folders alone, the step it must restore: the
newest step one save (its step, process count and global layout) covers in full with the
committed step folders, set-aside older layouts and peer copies of the nodes this job has,
unless the newest persistent step is newer. The prediction reads only manifests (which
global boxes each folder holds), not the restore planner. After each job it checks that
every committed folder verifies, that no node lost a step a returned `save()` had committed,
and that the job's own folders still give at least the step it restored; and when the next
job reaches every folder of the one before (no folder lost), it must restore at least the
newest step that job committed on every node (the on-demand step after a SIGTERM). A last
job only restores.

ORBAX_MTC_ELASTIC_KILLS (jobs ended by a signal, default 8; the gs:// chain half as many, at
least 4) and ORBAX_MTC_ELASTIC_SEED choose the chains; a failure prints the chain so far.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import signal
import sys
import uuid
from collections.abc import Callable

import pytest
import warm_start
from chaos_support import (
  after_saving_line,
  apply_fault,
  check_after_job,
  check_ending,
  draw_plan,
  durable_floor,
  early_moment,
  strike,
)
from gcs_server import BUCKET, bucket_objects
from gcs_server import committed_steps as committed_gs_steps
from mp_helpers import WORKER, child_env, mp_events, tail

from orbax_mtc.local import aside
from orbax_mtc.local.store import committed_steps, read_manifest
from orbax_mtc.peers import copy_store as peer_store

KILLS = int(os.environ.get("ORBAX_MTC_ELASTIC_KILLS", "8"))
SEED = int(os.environ.get("ORBAX_MTC_ELASTIC_SEED", "20261129"))
TIMEOUT_S = 120
# (processes, devices per process): two data replicas each, 2 or 4 devices in all.
LAYOUTS = ((1, 2), (2, 1), (2, 2), (4, 1))
MOST_NODES = max(procs for procs, _ in LAYOUTS)
BACKUP_EVERY = 4
ARGS = ["--rows", "16384", "--seed", "5", "--local-interval", "1", "--local-keep", "2",
        "--persistent-interval", str(BACKUP_EVERY), "--persistent-keep", "2", "--replicas", "2",
        "--shape-axes", "2,2", "--explicit-args"]
# What happens to the folders after a kill, drawn without replacement from repeats of this.
FAULT_CYCLE = ("none", "swap", "replace", "none", "none", "replace")
pytestmark = pytest.mark.timeout(60 + (KILLS + 1) * 2 * TIMEOUT_S)


def _save_of(folder: pathlib.Path) -> tuple[tuple, set]:
  """(step, process count, global layout) of the save a step folder belongs to, and the
  (item, leaf, box) pieces it holds of it; the layout is every array leaf's tiles, so two
  saves of one step on different meshes never mix."""
  manifest = read_manifest(folder)
  leaves = [(name, leaf) for name, item in sorted(manifest.items.items())
            for leaf in item.leaves if leaf.kind == "array"]
  assert all(leaf.tiles is not None for _, leaf in leaves), folder
  layout = tuple((name, leaf.path, tuple(sorted(index for index, _ in leaf.tiles)))
                 for name, leaf in leaves)
  pieces = {(name, leaf.path, shard.index) for name, leaf in leaves for shard in leaf.shards}
  return (manifest.step, manifest.process_count, layout), pieces


def newest_ram_step(root: pathlib.Path, procs: int) -> int | None:
  """The newest step some save covers in full with what nodes 0..procs-1 hold: their own
  committed steps, the older layouts' folders they set aside (a write-back after an elastic
  restore), and their peer copies; a copy whose twin shards lie in the receiver's own folder
  counts only beside an own folder of the same save."""
  held: dict[tuple, set] = {}
  for node in range(procs):
    node_dir = root / f"node{node}"
    own = [node_dir / str(step) for step in committed_steps(node_dir)]
    own += [path for _, path in aside.replaced_folders(node_dir)]
    own_saves = set()
    for folder in own:
      save, pieces = _save_of(folder)
      own_saves.add(save)
      held.setdefault(save, set()).update(pieces)
    store = peer_store.PeerStore(node_dir, max_to_keep=None)
    for source, step in store.copies():
      save, pieces = _save_of(store.source_dir(source) / str(step))
      if not store.meta(source, step).needs_own_step or save in own_saves:
        held.setdefault(save, set()).update(pieces)
  covered = [step for (step, _, layout), pieces in held.items()
             if all((name, path, index) in pieces for name, path, indices in layout
                    for index in indices)]
  return max(covered, default=None)


def local_backups(persistent: pathlib.Path) -> tuple[Callable[[], list[int]],
                                                     Callable[[], list[str]]]:
  """How to list a local persistent folder's committed steps (renamed in when complete) and
  the folders of backups cut before their commit."""
  def entries() -> list[str]:
    return [p.name for p in persistent.iterdir()] if persistent.is_dir() else []
  return (lambda: sorted(int(name) for name in entries() if name.isdigit()),
          lambda: sorted(name for name in entries() if not name.isdigit()))


def gs_backups(server, run: str) -> tuple[Callable[[], list[int]], Callable[[], list[str]]]:
  """How to list the committed steps of a persistent folder on Cloud Storage (those with
  Orbax's commit marker) and the step folders of uploads cut before it."""
  def committed() -> list[int]:
    return committed_gs_steps(bucket_objects(server, f"{run}/"), run)

  def cut() -> list[str]:
    objects = bucket_objects(server, f"{run}/")
    done = {str(step) for step in committed_gs_steps(objects, run)}
    return sorted({name.split("/")[1] for name in objects if name.count("/") > 1} - done)
  return committed, cut


def expected_restore(root: pathlib.Path, procs: int, backups: Callable[[], list[int]]
                     ) -> tuple[int | None, str]:
  """(step, "ram" | "persistent" | "none") a job of `procs` processes must restore."""
  ram = newest_ram_step(root, procs)
  backup = max(backups(), default=None)
  if ram is not None and (backup is None or ram >= backup):
    return ram, "ram"
  if backup is not None:
    return backup, "persistent"
  return None, "none"


def check_results(out, procs: int, expected: tuple[int | None, str], *,
                  every_process: bool = True) -> None:
  """Each RESULT line (one from every process unless `every_process` is False: a job killed
  early may end before some restore) names the expected step and tier, with bit-exact data."""
  results = mp_events.parse_results(out.lines)
  if every_process:
    assert sorted(results) == list(range(procs)), f"missing RESULT lines:\n{tail(out)}"
  step, kind = expected
  for node, fields in sorted(results.items()):
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
    tier = fields["tier"]
    got = "none" if tier == "none" else "persistent" if tier == "persistent" else "ram"
    assert (fields["step"], got) == (str(step), kind), (
        f"node {node} restored step {fields['step']} from {tier}, expected step {step} from "
        f"{kind}\n{tail(out)}")
    # restore(None) and restore(latest_step()) alike: the listing names the step restored,
    # before and after (newer leftovers dropped, the step listed while written back).
    assert (fields["listed"], fields["after"]) == (str(step),) * 2, (
        f"node {node}: latest_step() was {fields['listed']} before restoring step {step}, "
        f"{fields['after']} after\n{tail(out)}")


@dataclasses.dataclass(frozen=True)
class Chain:
  """What every job of one chain shares: its RAM root, its persistent folder (a local path or
  gs://...), the environment that reaches it, and how to list its committed steps."""

  root: pathlib.Path
  persistent: str
  env: dict[str, str]
  backups: Callable[[], list[int]]
  cut_backups: Callable[[], list[str]]


def _job(chain: Chain, subcommand: str, layout: tuple[int, int], out,
         extra: tuple[str, ...] = (), *, resume: bool) -> warm_start.WarmJob:
  procs, devices = layout
  return warm_start.WarmJob(
      [sys.executable, str(WORKER), subcommand, "--persistent-dir", chain.persistent, *ARGS,
       *extra, *(["--resume-latest"] if resume else [])], procs,
      devices_per_process=devices, local_root=chain.root, env={**child_env(), **chain.env},
      output=out)


def run_job(chain: Chain, ending: str, victim: int, rng: random.Random,
            layout: tuple[int, int], resume: bool):
  """One job of the chain, ended as `ending` says: "kill" (SIGKILL to `victim` 0-40 ms after
  its 1st-6th SAVING line, or 3 times in 10 0-300 ms after it began saving a step the
  persistent tier takes), "early" (SIGKILL to `victim` 0-1 s after the job started or
  0-30 ms after its restore returned: in its start, its restore, the restore's write-back or
  its first saves), "term" (SIGTERM to `victim` 0-200 ms after every process is
  training: every process saves on demand and exits) or "restore" (it only restores).
  `resume`: it restores `latest_step()` by number (Orbax's and MaxText's resume), not None.
  Returns (LaunchResult, its lines, what was done, whether the moment came in time)."""
  out = mp_events.LineCollector()
  if ending == "restore":
    with _job(chain, "restore", layout, out, resume=resume) as job:
      job.start()
      return job.wait(timeout_s=TIMEOUT_S), out, "restore only", True
  procs = layout[0]
  if ending == "early":
    delay_s, ready, done = early_moment(rng, victim)
    with _job(chain, "chaos", layout, out, resume=resume) as job:
      job.start()
      seen = strike(job, out, ready, delay_s, victim, signal.SIGKILL, TIMEOUT_S)
      return job.wait(timeout_s=TIMEOUT_S), out, done, seen
  if ending == "term":
    delay_s = rng.uniform(0.0, 0.2)
    ready = lambda lines: {n for n, _ in mp_events.events(lines, "READY")} == set(range(procs))  # noqa: E731
    subcommand, extra, sig = "preempt", ("--exit-after",), signal.SIGTERM
    done = f"SIGTERM to node {victim} {delay_s * 1000:.0f} ms after every process trained"
  elif rng.random() < 0.3:  # into a backup: the save of a step the persistent tier takes
    delay_s = rng.uniform(0.0, 0.3)
    ready = lambda lines: any(  # noqa: E731
        n == victim and int(f["step"]) % BACKUP_EVERY == 0 and int(f["step"]) > 0
        for n, f in mp_events.events(lines, "SAVING"))
    subcommand, extra, sig = "chaos", (), signal.SIGKILL
    done = f"node {victim} killed {delay_s * 1000:.0f} ms after it began saving a backup step"
  else:
    delay_s, ready, done = after_saving_line(rng, victim)
    subcommand, extra, sig = "chaos", (), signal.SIGKILL
  with _job(chain, subcommand, layout, out, extra, resume=resume) as job:
    job.start()
    seen = strike(job, out, ready, delay_s, victim, sig, TIMEOUT_S)
    return job.wait(timeout_s=TIMEOUT_S), out, done, seen


@pytest.mark.parametrize("tier", ["local", "gs"])
def test_every_restart_on_any_layout_restores_the_newest_covered_step(tier, shm_root, tmp_path,
                                                                      request):
  rng = random.Random(f"elastic-chaos-{SEED}-{tier}")
  if tier == "gs":  # the persistent tier on a real GCS JSON-API server on loopback
    server = request.getfixturevalue("gcs")
    run = f"chaos-{uuid.uuid4().hex[:8]}"
    chain = Chain(shm_root, f"gs://{BUCKET}/{run}", server.env(), *gs_backups(server, run))
  else:
    persistent = tmp_path / "persistent"
    chain = Chain(shm_root, str(persistent), {}, *local_backups(persistent))
  kills = KILLS if tier == "local" else max(4, KILLS // 2)
  # Every layout at least once, the rest drawn at random, in random order.
  layouts = [*LAYOUTS, *(rng.choice(LAYOUTS) for _ in range(kills + 1 - len(LAYOUTS)))]
  rng.shuffle(layouts)
  faults, endings = draw_plan(rng, kills, FAULT_CYCLE)
  summary: list[str] = []
  kinds: set[str] = set()
  cut_backups: set[str] = set()  # backups cut before their commit, left by the jobs
  cutting_jobs = 0
  # (a step the next job must reach, the ranks needed to reach it, how the job before ended)
  floor: tuple[int | None, int, str] | None = None
  for iteration, (layout, ending) in enumerate(zip(layouts, endings, strict=True)):
    procs = layout[0]
    expected = expected_restore(shm_root, procs, chain.backups)
    kinds.add(expected[1])
    if floor is not None and floor[0] is not None and procs >= floor[1]:
      # Every folder of the last job is under some rank of this one: nothing it had
      # committed everywhere may be gone.
      assert expected[0] is not None and expected[0] >= floor[0], (
          f"job {iteration} on {procs}x{layout[1]} can restore only {expected}, but the job "
          f"before committed step {floor[0]} on every node ({floor[2]})\n" + "\n".join(summary))
    victim = rng.randrange(procs)
    # Drawn apart, so that a seed's chain stays what it was.
    resume = random.Random(f"resume-{SEED}-{tier}-{iteration}").random() < 0.5
    result, out, done, seen = run_job(chain, ending, victim, rng, layout, resume)
    done += ", resumed by restore(latest_step())" if resume else ""
    (tmp_path / f"job{iteration}.log").write_text(out.text())
    context = "\n".join([*summary, f"job {iteration} on {procs}x{layout[1]} expecting "
                         f"{expected}, {done}: {result}", tail(out)])
    assert seen, f"the job did not get there in time:\n{context}"
    try:
      check_results(out, procs, expected, every_process=ending != "early")
    except AssertionError as e:
      raise AssertionError(f"{e}\n{context}") from None
    reached = check_ending(ending, result, out, procs, victim, context)
    if ending == "restore":
      break
    try:
      check_after_job(shm_root, procs, out, expected[0])
    except AssertionError as e:
      raise AssertionError(f"{e}\n{context}") from None
    # Whatever the job did before it died (a restore's write-back, retention, dropping an
    # abandoned timeline), its own folders still give at least the step it restored.
    after = expected_restore(shm_root, procs, chain.backups)
    assert expected[0] is None or (after[0] is not None and after[0] >= expected[0]), (
        f"after the job its folders give {after}, older than the step {expected[0]} it "
        f"restored\n{context}")
    cut_now = set(chain.cut_backups())
    cutting_jobs += bool(cut_now - cut_backups)
    cut_backups |= cut_now
    fault, touched = apply_fault(faults[iteration], shm_root, rng, MOST_NODES)
    # After no fault or a swap every folder of this job is under ranks 0..reach-1.
    floor = None if fault is not None and not fault.endswith("swapped") else (
        reached if ending == "term" else durable_floor(out, procs, expected[0]),
        max([procs, *(n + 1 for n in touched)]), f"{done}, {fault or 'no fault'}")
    summary.append(
        f"job {iteration} on {procs}x{layout[1]}: restored {expected}; {done}; committed "
        f"{[committed_steps(shm_root / f'node{n}') for n in range(MOST_NODES)]}, persistent "
        f"{chain.backups()}"
        f"{'' if fault is None else f', {fault}'}"
        f"{'' if floor is None else f'; next must reach step {floor[0]} on {floor[1]}+ ranks'}")
  summary.append(f"jobs that left a backup cut before its commit: {cutting_jobs}")
  print("\n".join(summary))
  # The chain restored from RAM, and from the persistent tier when RAM could not cover.
  assert "ram" in kinds, "\n".join(summary)
