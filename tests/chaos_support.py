"""Checks the randomized fault campaigns share: what a chain of killed jobs must leave behind."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import time
from collections.abc import Callable, Sequence

import pytest
from mp_helpers import mp_events

from orbax_mtc.local.format import LocalTierError
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps


def check_after_job(root: pathlib.Path, procs: int, out, restored: int | None) -> None:
  """Every committed folder under the root verifies; no node of the job lost a step that a
  returned save() had committed there."""
  for node_dir in sorted(root.glob("node*")):
    for step in committed_steps(node_dir):
      try:
        verify_step(node_dir / str(step))
      except LocalTierError as e:
        pytest.fail(f"{node_dir.name}: committed step {step} does not verify: {e}")
  start = -1 if restored is None else restored
  for node in range(procs):
    steps = committed_steps(root / f"node{node}")
    saved = [int(f["step"]) for n, f in mp_events.events(out.lines, "SAVED") if n == node]
    # save(k) returns only after this node's write of k-1 committed.
    if saved and saved[-1] - 1 > start:
      assert max(steps, default=-1) >= saved[-1] - 1, (
          f"node {node}: save({saved[-1]}) returned, so step {saved[-1] - 1} was committed, "
          f"but the folder holds {steps}")


def durable_floor(out, procs: int, restored: int | None) -> int | None:
  """The newest step every node of a killed job is known to have committed, or restored:
  each node committed the step before the last `save()` that returned on it, and retention
  keeps the newest step every node holds."""
  last_saved = [max((int(f["step"]) for n, f in mp_events.events(out.lines, "SAVED")
                     if n == node), default=None) for node in range(procs)]
  floor = restored
  if all(step is not None for step in last_saved):
    committed_everywhere = min(last_saved) - 1
    if committed_everywhere >= 0 and (floor is None or committed_everywhere > floor):
      floor = committed_everywhere
  return floor


def ondemand_step(out, procs: int) -> int | None:
  """The step every process said it saved on demand at, if all said the same one."""
  steps = {n: int(f["step"]) for n, f in mp_events.events(out.lines, "PREEMPTED")}
  same = set(steps.values())
  return same.pop() if sorted(steps) == list(range(procs)) and len(same) == 1 else None


def check_ending(ending: str, result, out, procs: int, victim: int, context: str
                 ) -> int | None:
  """How a campaign's job must have ended, none timed out: a restore-only job or a SIGTERM
  with status 0 on every process (each saved the one step they agreed on, then exited), a
  kill with 137 on its victim. Returns the on-demand step after a SIGTERM, else None."""
  assert not result.timed_out, context
  if ending in ("restore", "term"):
    assert result.returncode == 0, context
  else:
    assert result.returncodes[victim] == 137, context
  if ending != "term":
    return None
  reached = ondemand_step(out, procs)
  assert reached is not None, f"no one on-demand step:\n{context}"
  return reached


def draw_plan(rng: random.Random, kills: int, fault_cycle: Sequence[str]
              ) -> tuple[list[str], list[str]]:
  """A chain's faults between jobs (drawn without replacement from repeats of `fault_cycle`)
  and its jobs' endings: half "kill", a quarter "early", a quarter "term", in random order,
  then one "restore"."""
  faults = [fault_cycle[i % len(fault_cycle)] for i in range(kills)]
  rng.shuffle(faults)
  endings = [("kill", "early", "kill", "term")[i % 4] for i in range(kills)]
  rng.shuffle(endings)
  return faults, [*endings, "restore"]


def apply_fault(fault: str, root: pathlib.Path, rng: random.Random, most_nodes: int
                ) -> tuple[str | None, frozenset[int]]:
  """Deletes one node's RAM folder ("replace") or exchanges two nodes' folders ("swap": the
  processes restart with permuted ids); returns what it did and the nodes it touched."""
  present = [n for n in range(most_nodes) if (root / f"node{n}").is_dir()]
  if fault == "replace" and present:
    lost = rng.choice(present)
    shutil.rmtree(root / f"node{lost}")
    return f"node{lost} replaced", frozenset({lost})
  if fault == "swap" and present:
    first = rng.choice(present)
    second = rng.choice([n for n in range(most_nodes) if n != first])
    parked = root / "swapping"
    (root / f"node{first}").rename(parked)
    if (root / f"node{second}").exists():
      (root / f"node{second}").rename(root / f"node{first}")
    parked.rename(root / f"node{second}")
    return f"node{first} and node{second} swapped", frozenset({first, second})
  return None, frozenset()


def after_saving_line(rng: random.Random, victim: int
                      ) -> tuple[float, Callable[[list[str]], bool], str]:
  """The usual kill moment, 0-40 ms after the victim's seeded-random 1st-6th "SAVING" line:
  (the delay, whether the line came, what it says)."""
  delay_s, saves = rng.uniform(0.0, 0.04), rng.randint(1, 6)

  def ready(lines: list[str]) -> bool:
    return sum(1 for n, _ in mp_events.events(lines, "SAVING") if n == victim) >= saves
  return delay_s, ready, f"node {victim} killed {delay_s * 1000:.0f} ms after its SAVING line #{saves}"


def strike(job, out, ready: Callable[[list[str]], bool] | None, delay_s: float, victim: int,
           sig: int, timeout_s: float) -> bool:
  """Once `ready` holds for the job's lines (None: at once), sends `sig` to process `victim`
  `delay_s` later; returns whether the moment came within `timeout_s`."""
  seen = ready is None or out.wait_for(ready, timeout_s=timeout_s)
  if seen:
    time.sleep(delay_s)  # the random moment, not a synchronisation
    os.kill(job.pids[victim], sig)
  return seen


def early_moment(rng: random.Random, victim: int
                 ) -> tuple[float, Callable[[list[str]], bool] | None, str]:
  """A kill in a job's start, restore or first saves: half the time 0-1 s after the start,
  half 0-30 ms after the victim's restore returned (its RESULT line). As `after_saving_line`
  (None: from the start)."""
  after_restore = rng.random() < 0.5
  delay_s = rng.uniform(0.0, 0.03 if after_restore else 1.0)

  def ready(lines: list[str]) -> bool:
    return any(n == victim for n, _ in mp_events.events(lines, "RESULT"))
  return delay_s, ready if after_restore else None, (
      f"node {victim} killed {delay_s * 1000:.0f} ms after "
      f"{'its restore returned' if after_restore else 'the job started'}")
