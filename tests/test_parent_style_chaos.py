"""A randomized fault campaign for the parent-style form: Orbax's own manager with a RAM tier.

One chain of 2-process jobs (`mp_worker parent-resume`: `mtc.CheckpointManager(directory,
options=ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3),
local_directory=...)`, the constructor of `ocp.CheckpointManager` plus one argument). Each job
resumes as Orbax users do, `restore(latest_step())`, checks the state bit for bit on every
process, then saves every step until the test SIGKILLs one process: 0-40 ms after its
seeded-random n-th "SAVING" line (three jobs in four), or 0-1 s after the start (in the
restore, the drop of what it abandoned, the first saves). Between jobs one node's RAM folder
may be deleted (node replaced) or two nodes' folders exchanged (ids permuted), or a new run
begins over the RAM folders: a fresh persistent folder and another state (seed), nothing
restored, its first step two below the old run's newest, so that it saves over the old
run's steps and their peer copies (in the chain without data replicas, each node's copy on
the next node; the chain with two replicas, twins, has no new runs).

The parent decides: each job must restore the newest step Orbax committed in the persistent
folder (from RAM when the cluster holds it, else Orbax reads it), and after each kill every
committed RAM folder must verify and no node may have lost a step a returned `save()` had
committed there.

ORBAX_MTC_PARENT_KILLS (default 6) and ORBAX_MTC_PARENT_SEED choose the chain.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import signal
import sys

import pytest
import warm_start
from chaos_support import after_saving_line, apply_fault, check_after_job, check_ending, strike
from mp_helpers import WORKER, child_env, mp_events, tail

from orbax_mtc.local.store import committed_steps

KILLS = int(os.environ.get("ORBAX_MTC_PARENT_KILLS", "6"))
SEED = int(os.environ.get("ORBAX_MTC_PARENT_SEED", "20261129"))
TIMEOUT_S = 120
PROCS = 2
FAULT_CYCLE = ("none", "replace", "none", "swap")
# The chain without replicas also starts new runs over the RAM folders.
NEW_RUN_CYCLE = (*FAULT_CYCLE, "new-run")
pytestmark = pytest.mark.timeout(60 + (KILLS + 1) * 2 * TIMEOUT_S)


def orbax_latest(persistent: pathlib.Path) -> int | None:
  """The newest step Orbax committed (its step folders appear by rename when complete)."""
  steps = [int(p.name) for p in persistent.iterdir() if p.name.isdigit()] \
      if persistent.is_dir() else []
  return max(steps, default=None)


@dataclasses.dataclass
class Run:
  """One training run: its persistent folder, state seed and first step."""
  persistent: pathlib.Path
  seed: int = 5
  start: int = 0


def run_job(root: pathlib.Path, run: Run, replicas: int, ending: str, victim: int,
            rng: random.Random):
  """One job ended as `ending` says; (LaunchResult, lines, what was done, in time)."""
  out = mp_events.LineCollector()
  job = warm_start.WarmJob(
      [sys.executable, str(WORKER), "parent-resume", "--persistent-dir", str(run.persistent),
       "--rows", "16384", "--seed", str(run.seed), "--start", str(run.start), "--replicas",
       str(replicas), "--steps", "100000" if ending != "restore" else "0"],
      PROCS, devices_per_process=2, local_root=root, env=child_env(), output=out)
  with job:
    job.start()
    if ending == "restore":
      return job.wait(timeout_s=TIMEOUT_S), out, "restore only", True
    if ending == "early":
      delay_s, ready = rng.uniform(0.0, 1.0), None
      done = f"node {victim} killed {delay_s * 1000:.0f} ms after the job started"
    else:
      delay_s, ready, done = after_saving_line(rng, victim)
    seen = strike(job, out, ready, delay_s, victim, signal.SIGKILL, TIMEOUT_S)
    return job.wait(timeout_s=TIMEOUT_S), out, done, seen


@pytest.mark.parametrize("replicas", [2, 1], ids=["twins", "next-node"])
def test_every_resume_restores_orbaxs_latest_step_bit_for_bit(shm_root, tmp_path, replicas):
  rng = random.Random(f"parent-chaos-{SEED}" if replicas > 1 else
                      f"parent-chaos-{SEED}-next-node")
  cycle = FAULT_CYCLE if replicas > 1 else NEW_RUN_CYCLE
  run = Run(tmp_path / "persistent")
  endings = [("kill", "early", "kill", "kill")[i % 4] for i in range(KILLS)]
  rng.shuffle(endings)
  faults = [cycle[i % len(cycle)] for i in range(KILLS)]
  rng.shuffle(faults)
  summary: list[str] = []
  tiers: set[str] = set()
  for iteration, ending in enumerate([*endings, "restore"]):
    expected = orbax_latest(run.persistent)
    victim = rng.randrange(PROCS)
    result, out, done, seen = run_job(shm_root, run, replicas, ending, victim, rng)
    (tmp_path / f"job{iteration}.log").write_text(out.text())
    context = "\n".join([*summary, f"job {iteration} expecting {expected}, {done}: {result}",
                         tail(out)])
    assert seen, f"the job did not get there in time:\n{context}"
    results = mp_events.parse_results(out.lines)
    if ending != "early" and expected is not None:
      assert sorted(results) == list(range(PROCS)), f"missing RESULT lines:\n{context}"
    for node, fields in sorted(results.items()):
      assert fields["ok"] == "1", f"node {node}: restored data differs\n{context}"
      assert fields["step"] == str(expected), f"node {node} restored {fields['step']}\n{context}"
      tiers.add(fields["tier"])
    check_ending(ending, result, out, PROCS, victim, context)
    if ending == "restore":
      break
    try:
      check_after_job(shm_root, PROCS, out, expected)
    except AssertionError as e:
      raise AssertionError(f"{e}\n{context}") from None
    after = orbax_latest(run.persistent)
    assert expected is None or (after is not None and after >= expected), context
    if faults[iteration] == "new-run":
      run = Run(tmp_path / f"persistent-{iteration}", seed=run.seed + 1,
                start=max(0, (after or 0) - 2))
      fault = f"a new run (seed {run.seed}) from step {run.start}"
    else:
      fault, _ = apply_fault(faults[iteration], shm_root, rng, PROCS)
    summary.append(f"job {iteration}: restored {expected} ({sorted(tiers)}); {done}; RAM "
                   f"{[committed_steps(shm_root / f'node{n}') for n in range(PROCS)]}, Orbax "
                   f"{after}{'' if fault is None else f', {fault}'}")
  print("\n".join(summary))
  # A restore came from RAM (with new runs in a short chain, maybe not from own folders).
  assert "local" in tiers if replicas > 1 else tiers & {"local", "peer", "elastic"}, \
      "\n".join(summary)
