"""A randomized fault campaign in managed mode: jobs under GKE's replicator, killed at random.

One chain of jobs on one set of RAM-disk volumes, each node with its replicator simulator
(tests/replicator_sim.py, as the DaemonSet pod beside the job: it copies every committed step
to the node's twin and backs some up, and names the step to restore in `.restore` entries).
Every job (`--mode managed`, two data replicas, RAM every step, keep 2) makes the handshake,
restores what the replicator names, checks it bit for bit on every process against the state
recomputed for that step, then saves every step until the test ends it: half of the jobs with
a SIGKILL to one process 0-40 ms after its seeded-random n-th "SAVING" line, a quarter with a
SIGKILL 0-1 s after the start or 0-30 ms after the process's restore returned (in the
handshake, the entry's take-over or the first saves), a quarter with a SIGTERM to one process
(every process saves the step they agree on and exits 0). Between jobs a node may be replaced
(its simulator killed, its volume deleted, a new simulator started) or its replicator
restarted (the volume kept).

After each job, once every simulator has caught up with the committed steps (its `IDLE` line;
the real daemon has the minutes a restart takes), the test checks that every committed folder
verifies and that no node lost a step a returned `save()` had committed. The next job must
restore exactly the step every simulator names, from the replicator, bit for bit (where they
name none, step 0 from the nodes' own folders if every node holds it: no entry can name it),
and `latest_step()` (MaxText's resume by number) must name it too, before and after; and
unless a node was replaced, at least the newest step the job before committed on every node
(the on-demand step after a SIGTERM) or restored. A last job only restores.

ORBAX_MTC_MANAGED_KILLS (jobs ended by a signal, default 6 a chain) and
ORBAX_MTC_MANAGED_SEED choose the chains; a failure prints the chain so far.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import sys

import pytest
import warm_start
from chaos_support import (
  after_saving_line,
  check_after_job,
  check_ending,
  draw_plan,
  durable_floor,
  early_moment,
  strike,
)
from mp_helpers import WORKER, child_env, mp_events, tail
from sim_nodes import SimNode, simulators

from orbax_mtc.local.store import committed_steps

KILLS = int(os.environ.get("ORBAX_MTC_MANAGED_KILLS", "6"))
SEED = int(os.environ.get("ORBAX_MTC_MANAGED_SEED", "20261129"))
TIMEOUT_S = 120
JOB = "chaosjob"
ARGS = ["--mode", "managed", "--job-name", JOB, "--managed-timeout", "60", "--rows", "16384",
        "--seed", "5", "--local-interval", "1", "--local-keep", "2", "--persistent-interval",
        "4", "--replicas", "2", "--explicit-args"]
# What happens to the nodes after a job, drawn without replacement from repeats of this.
FAULT_CYCLE = ("none", "replace", "daemon", "none", "replace", "none")
pytestmark = pytest.mark.timeout(60 + (KILLS + 1) * 3 * TIMEOUT_S)


def _settled(sim: SimNode) -> bool:
  """Whether the simulator has handled every step committed in its volume (or never took a
  configuration: then it copies nothing until the next job's)."""
  if not sim.events("CONFIG"):
    return True
  idle = sim.events("IDLE")
  if not idle:
    return False
  handled = idle[-1]["steps"]
  return set(committed_steps(sim.volume)) <= (
      set() if handled == "-" else {int(s) for s in handled.split(",")})


def settle(sims: list[SimNode]) -> None:
  for sim in sims:
    assert sim.wait_until(lambda sim=sim: _settled(sim), TIMEOUT_S), (
        f"the simulator of {sim.volume.name} did not catch up:\n{sim.text()}")


def named_step(sims: list[SimNode], before: list[int]) -> int | None:
  """The step every simulator's newest `RESTORE` line names (None: they differ, or some made
  none), counting only the lines after `before` (how many each had)."""
  named = set()
  for sim, seen in zip(sims, before, strict=True):
    lines = sim.events("RESTORE")[seen:]
    if not lines:
      return None
    named.add(int(lines[-1]["step"]))
  return named.pop() if len(named) == 1 else None


def apply_fault(fault: str, sims: list[SimNode], root: pathlib.Path, backup: pathlib.Path,
                rng: random.Random) -> str | None:
  """Replaces one node (its simulator and volume) or restarts its replicator."""
  if fault == "none":
    return None
  node = rng.randrange(len(sims))
  sims[node].kill()
  if fault == "replace":
    shutil.rmtree(root / f"node{node}", ignore_errors=True)
  sims[node] = SimNode(root, node, backup)
  return f"node{node} {'replaced' if fault == 'replace' else 'replicator restarted'}"


def run_job(root: pathlib.Path, persistent: pathlib.Path, layout: tuple[int, int],
            ending: str, victim: int, rng: random.Random):
  """One job, ended as `ending` says ("kill", "early", "term" or "restore"); returns
  (LaunchResult, its lines, what was done, whether the moment came in time)."""
  procs, devices = layout
  out = mp_events.LineCollector()
  subcommand = {"term": "preempt", "restore": "restore"}.get(ending, "chaos")
  extra = ["--exit-after"] if ending == "term" else []
  job = warm_start.WarmJob(
      [sys.executable, str(WORKER), subcommand, "--persistent-dir", str(persistent), *ARGS,
       *extra], procs, devices_per_process=devices, local_root=root, env=child_env(),
      output=out)
  with job:
    job.start()
    if ending == "restore":
      return job.wait(timeout_s=TIMEOUT_S), out, "restore only", True
    sig = signal.SIGTERM if ending == "term" else signal.SIGKILL
    if ending == "early":
      delay_s, ready, done = early_moment(rng, victim)
    elif ending == "term":
      delay_s = rng.uniform(0.0, 0.2)
      ready = lambda lines: {n for n, _ in mp_events.events(lines, "READY")} == set(  # noqa: E731
          range(procs))
      done = f"SIGTERM to node {victim} {delay_s * 1000:.0f} ms after every process trained"
    else:
      delay_s, ready, done = after_saving_line(rng, victim)
    seen = strike(job, out, ready, delay_s, victim, sig, TIMEOUT_S)
    return job.wait(timeout_s=TIMEOUT_S), out, done, seen


def check_results(out, procs: int, step: int | None, *, every_process: bool) -> None:
  """Each RESULT line names `step` (None: nothing restored) from the replicator, or step 0
  from the nodes' own folders (no entry can name it), bit-exact."""
  results = mp_events.parse_results(out.lines)
  if every_process:
    assert sorted(results) == list(range(procs)), f"missing RESULT lines:\n{tail(out)}"
  want = (("None", "none") if step is None else ("0", "local") if step == 0
          else (str(step), "replicator"))
  for node, fields in sorted(results.items()):
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
    assert (fields["step"], fields["tier"]) == want, (
        f"node {node} restored step {fields['step']} from {fields['tier']}, expected {want}"
        f"\n{tail(out)}")
    # MaxText resumes by restore(latest_step()) in managed mode too: the listing must name
    # the step restore(None) restores, before and after.
    assert (fields["listed"], fields["after"]) == (want[0], want[0]), (
        f"node {node}: latest_step() was {fields['listed']} before and {fields['after']} "
        f"after restoring {want}\n{tail(out)}")


@pytest.mark.parametrize("layout", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_every_restart_under_the_replicator_restores_the_step_it_names(layout, shm_root,
                                                                       tmp_path):
  rng = random.Random(f"managed-chaos-{SEED}-{layout}")
  procs = layout[0]
  backup, persistent = tmp_path / "backup", tmp_path / "persistent"
  faults, endings = draw_plan(rng, KILLS, FAULT_CYCLE)
  summary: list[str] = []
  sources: set[str] = set()
  floor: tuple[int, str] | None = None  # a step the next job must reach, and why
  with simulators(shm_root, backup, procs) as sims:
    for iteration, ending in enumerate(endings):
      before = [len(sim.events("RESTORE")) for sim in sims]
      victim = rng.randrange(procs)
      # Entries cannot name step 0: where every node holds it, restore(None) restores it.
      zero_held = all(0 in committed_steps(shm_root / f"node{n}") for n in range(procs))
      result, out, done, seen = run_job(shm_root, persistent, layout, ending, victim, rng)
      (tmp_path / f"job{iteration}.log").write_text(out.text())
      named = named_step(sims, before)
      restored = None if named == 0 and not zero_held else named
      context = "\n".join([*summary, f"job {iteration}: the replicator named {named}, {done}: "
                           f"{result}", tail(out), *(sim.text() for sim in sims)])
      assert seen, f"the job did not get there in time:\n{context}"
      results = mp_events.parse_results(out.lines)
      if results:  # every process made the handshake: every simulator answered it
        assert named is not None, f"the simulators named different steps:\n{context}"
        sources.update(sim.events("RESTORE")[-1]["source"] for sim in sims)
      if floor is not None and named is not None:
        assert named >= floor[0], (
            f"job {iteration} restores step {named}, but the job before {floor[1]}: "
            f"step {floor[0]}\n{context}")
      try:
        check_results(out, procs, restored, every_process=ending != "early")
      except AssertionError as e:
        raise AssertionError(f"{e}\n{context}") from None
      reached = check_ending(ending, result, out, procs, victim, context)
      if ending == "restore":
        break
      if reached is None:
        reached = durable_floor(out, procs, restored)
      settle(sims)
      try:
        check_after_job(shm_root, procs, out, restored)
      except AssertionError as e:
        raise AssertionError(f"{e}\n{context}") from None
      fault = apply_fault(faults[iteration], sims, shm_root, backup, rng)
      if (fault or "").endswith("replaced"):
        floor = None  # its newest steps may not have reached its twin
      elif reached is not None and (floor is None or reached > floor[0]):
        floor = (reached, f"{done}, {fault or 'no fault'}, had committed on every node")
      summary.append(
          f"job {iteration}: restored {named}; {done}; committed "
          f"{[committed_steps(shm_root / f'node{n}') for n in range(procs)]}"
          f"{'' if fault is None else f', {fault}'}")
  print("\n".join(summary))
  # The chain restored from the nodes' own steps and from what the replicator copied.
  assert "own" in sources, "\n".join(summary)
