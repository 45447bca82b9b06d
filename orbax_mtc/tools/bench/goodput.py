"""`orbax-mtc bench goodput`: one training job, one seeded schedule of failures, two systems.

The same multi-process job (`goodput_train`) runs to `--steps` twice in one benchmark run:
with orbax-mtc (RAM every few steps, peers, persistent rarely) and with plain Orbax
checkpointing to the persistent folder only, at the same persistent interval. Failures come
at seeded steps (the first time the job gets there): a SIGTERM to one process (maintenance:
on-demand save, then the job stops), a SIGKILL of one process (the job dies), and a SIGKILL
whose node also loses its RAM folder (a replaced node). After each, the driver restarts the
job, as a scheduler would.

Reported per system: goodput = productive step time (steps x the median step's compute time)
/ wall time from first start to the last step, steps recomputed, time inside `save` and
`restore`, and per failure the steps lost and the time from the failure to the first step
after the restart. The persistent folder is local here, so plain Orbax's saves are cheaper
than they would be on Cloud Storage: the baseline is favoured, not handicapped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbax_mtc.tools.bench import limits, output

FAILURE_KINDS = ("sigterm", "sigkill", "wipe")
SYSTEMS = ("mtc", "orbax")
SCHEMA = "orbax-mtc/bench-goodput/1"
_JOB_TIMEOUT_S = 900.0


@dataclasses.dataclass
class Failure:
  kind: str  # one of FAILURE_KINDS
  at_step: int  # injected the first time the job reports this step
  node: int
  injected_at: float | None = None  # epoch seconds
  run: int | None = None  # the job run it hit


def make_schedule(seed: int, steps: int, nprocs: int,
                  kinds: Sequence[str] = FAILURE_KINDS) -> list[Failure]:
  """One failure of each kind, in seeded order, one per equal slice of 15-60 % of the run:
  after the first checkpoints, and early enough that a SIGTERM (which JAX's notifier notices
  within a second) is agreed on before the job ends."""
  rng = random.Random(seed)
  order = list(kinds)
  rng.shuffle(order)
  lo, hi = int(steps * 0.15), int(steps * 0.60)
  width = max(1, (hi - lo) // max(1, len(order)))
  out = []
  for i, kind in enumerate(order):
    start = lo + i * width
    out.append(Failure(kind=kind, at_step=rng.randrange(start, start + width),
                       node=rng.randrange(nprocs)))
  return out


def summarize(events: list[dict], failures: list[Failure], steps: int,
              wall_s: float) -> dict[str, Any]:
  """Goodput and its parts from process 0's report lines (pure)."""
  step_events = [e for e in events if e["event"] == "step"]
  starts = {e["run"]: e for e in events if e["event"] == "start"}
  compute = [e["compute_s"] for e in step_events]
  median_step = statistics.median(compute) if compute else float("nan")
  productive = steps * median_step
  saving = sum(e["save_s"] for e in step_events) + sum(
      e.get("wait_s", 0.0) for e in events if e["event"] in ("preempted", "done"))
  restoring = sum(e["restore_s"] for e in starts.values())
  # Where the time inside save() goes: steps that saved, and the calls in between (which move
  # peer copies forward).
  saves = [e["save_s"] for e in step_events if e.get("saved")]
  between = [e["save_s"] for e in step_events if not e.get("saved")]
  per_failure = []
  for f in failures:
    if f.run is None:
      continue
    before = [e["step"] for e in step_events if e["run"] == f.run]
    after = starts.get(f.run + 1)
    next_steps = [e["t"] for e in step_events if e["run"] == f.run + 1]
    per_failure.append({
        "kind": f.kind, "node": f.node, "at_step": f.at_step,
        "last_step": max(before) if before else None,
        "restored_step": after["restored"] if after else None,
        "restored_tier": after["tier"] if after else None,
        "steps_lost": (max(before) - after["restored"]) if before and after else None,
        "recovery_s": (min(next_steps) - f.injected_at)
        if next_steps and f.injected_at is not None else None,
    })
  return {
      "steps": steps, "wall_s": wall_s, "median_step_s": median_step,
      "productive_s": productive, "goodput": productive / wall_s if wall_s > 0 else None,
      "steps_executed": len(step_events), "steps_recomputed": len(step_events) - steps,
      "saving_s": saving, "restoring_s": restoring, "runs": len(starts),
      "save_calls": {"saving": limits.spread(saves) | {"total_s": sum(saves)},
                     "between": limits.spread(between) | {"total_s": sum(between)}},
      "failures": per_failure,
  }


class _Watch:
  """Output sink for the launcher: tracks node 0's newest step; wakes the driver."""

  def __init__(self):
    self.cond = threading.Condition()
    self.max_step = 0
    self.stepped = False  # this run has trained a step
    self.first_step: int | None = None  # this run's first step (its restored step + 1)
    self._partial = ""
    self.tail: list[str] = []

  def write(self, text: str) -> int:
    with self.cond:
      text = self._partial + text
      *lines, self._partial = text.split("\n")
      for line in lines:
        self.tail = (self.tail + [line])[-40:]
        if line.startswith("[node 0] @@gp STEP "):
          step = int(line.rsplit(" ", 1)[1])
          self.max_step = max(self.max_step, step)
          self.first_step = step if self.first_step is None else self.first_step
          self.stepped = True
      self.cond.notify_all()
    return len(text)

  def flush(self) -> None:
    pass


def _run_system(system: str, args, schedule: list[Failure], root: Path) -> dict[str, Any]:
  from orbax_mtc.tools import launch

  base = root / system
  shutil.rmtree(base, ignore_errors=True)
  (base / "persistent").mkdir(parents=True)
  report = base / "report.jsonl"
  failures = [dataclasses.replace(f) for f in schedule]
  pending = list(failures)
  reached = 0
  started = time.time()
  run = 0
  while True:
    run += 1
    if run > len(failures) + 3:
      raise RuntimeError(f"{system}: the job did not finish after {run - 1} runs")
    watch = _Watch()
    watch.max_step = reached
    command = [sys.executable, "-m", "orbax_mtc.tools.bench.goodput_train", "--system", system,
               "--persistent-dir", str(base / "persistent"), "--report", str(report),
               "--run", str(run), "--steps", str(args.steps), "--work", str(args.work),
               "--mib", str(args.mib), "--min-step-ms", str(args.min_step_ms),
               "--local-every", str(args.local_every),
               "--persistent-every", str(args.persistent_every)]
    job = launch.Job(command, args.procs, devices_per_process=1, local_root=base / "local",
                     env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=watch)
    wiped: int | None = None
    with job.start():
      deadline = time.monotonic() + _JOB_TIMEOUT_S
      while not job.poll():
        if time.monotonic() > deadline:
          raise RuntimeError(f"{system}: run {run} timed out:\n" + "\n".join(watch.tail))
        with watch.cond:
          watch.cond.wait(timeout=0.5)  # woken by output; the timeout notices exits
          reached = watch.max_step
          stepped = watch.stepped
        # One failure per run, once it trains: a job that goes on after its failure (SIGTERM:
        # to the agreed step) must not take the next one too, which belongs to the restart.
        if pending and stepped and reached >= pending[0].at_step and not any(
            f.run == run for f in failures):
          failure = pending.pop(0)
          failure.injected_at, failure.run = time.time(), run
          pid = job.pids[failure.node]
          os.kill(pid, signal.SIGTERM if failure.kind == "sigterm" else signal.SIGKILL)
          if failure.kind == "wipe":
            wiped = failure.node
      result = job.wait(timeout_s=_JOB_TIMEOUT_S)
    if wiped is not None:
      shutil.rmtree(job.local_directory(wiped), ignore_errors=True)
    events = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    if any(e["event"] == "done" and e["run"] == run for e in events):
      wall = max(e["t"] for e in events if e["event"] == "step") - started
      break
    if result.returncode == 0 and not any(f.run == run and f.kind == "sigterm"
                                          for f in failures):
      raise RuntimeError(f"{system}: run {run} stopped without finishing or a SIGTERM")
  shutil.rmtree(base / "local", ignore_errors=True)
  out = summarize(events, failures, args.steps, wall)
  out["system"] = system
  return out


def _markdown(runs: Sequence[dict[str, Any]], summary: dict[str, Any], args) -> str:
  lines = [f"Goodput, {args.procs} processes, {args.steps} steps, {args.mib} MiB per process, "
           f"one failure of each kind per seed", "",
           "| seed | system | goodput | wall | productive | steps recomputed | in save | "
           "in restore | " + " | ".join(f"{k}: lost / back in" for k in FAILURE_KINDS) + " |",
           "|---" * (8 + len(FAILURE_KINDS)) + "|"]
  for results in runs:
    for system in args.systems:
      r = results[system]
      cells = []
      for kind in FAILURE_KINDS:
        f = next((x for x in r["failures"] if x["kind"] == kind), None)
        cells.append("-" if f is None else f"{f['steps_lost']} steps / {f['recovery_s']:.1f} s")
      lines.append(f"| {results['seed']} | {system} | {100 * r['goodput']:.1f} % | "
                   f"{r['wall_s']:.1f} s | {r['productive_s']:.1f} s | "
                   f"{r['steps_recomputed']} | {r['saving_s']:.1f} s | "
                   f"{r['restoring_s']:.1f} s | " + " | ".join(cells) + " |")
  lines.append("")
  for system in args.systems:
    g = summary[system]
    lines.append(f"- {system}: median goodput {100 * g['median']:.1f} % "
                 f"(range {100 * g['min']:.1f}-{100 * g['max']:.1f} %)")
  if "ratio" in summary:
    q = summary["ratio"]
    lines.append(f"- orbax-mtc / Orbax goodput: median {q['median']:.2f}x "
                 f"(per seed: {', '.join(f'{x:.2f}x' for x in q['per_seed'])})")
  return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="orbax-mtc bench goodput", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--procs", type=int, default=2,
                 help="processes of the job, at least 2 (default: %(default)s)")
  p.add_argument("--steps", type=int, default=1500,
                 help="training steps each system runs to, at least 20 (default: %(default)s)")
  p.add_argument("--work", type=int, default=40,
                 help="256x256 matmuls per training step (default: %(default)s)")
  p.add_argument("--mib", type=int, default=16,
                 help="state MiB per process (default: %(default)s)")
  p.add_argument("--min-step-ms", type=float, default=0.0,
                 help="pad each training step to this long (simulated device time) "
                 "(default: %(default)s)")
  p.add_argument("--local-every", type=int, default=25,
                 help="orbax-mtc's RAM-tier save interval, in steps (default: %(default)s)")
  p.add_argument("--persistent-every", type=int, default=500,
                 help="persistent save interval of both systems, in steps "
                 "(default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the failure schedule (default: %(default)s)")
  p.add_argument("--seeds", type=int, nargs="+", default=None,
                 help="several schedules in one run (overrides --seed); the table gives "
                 "each and the median (default: --seed only)")
  p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                 help="systems to run (default: both)")
  p.add_argument("--out", default="goodput-results",
                 help="folder for goodput.json/.md (default: %(default)s)")
  p.add_argument("--scratch", default=None,
                 help="folder for both tiers while running, removed afterwards "
                 "(default: /dev/shm/orbax-mtc-goodput-<pid>)")
  output.add_json_flag(p, SCHEMA)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.procs < 2:
    parser.error("--procs must be >= 2: a node's loss is survived through its peers")
  if args.steps < 20:
    parser.error("--steps must be >= 20 to fit the failure schedule")
  seeds = args.seeds if args.seeds else [args.seed]
  scratch = Path(args.scratch or f"/dev/shm/orbax-mtc-goodput-{os.getpid()}")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  text = output.text(args.json)
  runs: list[dict[str, Any]] = []
  try:
    for seed in seeds:
      schedule = make_schedule(seed, args.steps, args.procs)
      results: dict[str, Any] = {"seed": seed, "schedule": schedule}
      for system in args.systems:
        print(f"== seed {seed}, {system}: {args.steps} steps, failures at "
              f"{[(f.kind, f.at_step, f.node) for f in schedule]}", file=text, flush=True)
        results[system] = _run_system(system, args, schedule, scratch)
        r = results[system]
        print(f"   goodput {100 * r['goodput']:.1f} % (wall {r['wall_s']:.1f} s, "
              f"{r['steps_recomputed']} steps recomputed)", file=text, flush=True)
      runs.append(results)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  summary = across_seeds(runs, args.systems)
  table = _markdown(runs, summary, args)
  raw = {"schema": SCHEMA,
         "runs": [{**{k: v for k, v in r.items() if k != "schedule"},
                   "schedule": [dataclasses.asdict(f) for f in r["schedule"]]} for r in runs],
         "summary": summary, "args": vars(args), "environment": _environment()}
  (out / "goodput.json").write_text(json.dumps(raw, indent=1))
  (out / "goodput.md").write_text(table)
  output.emit(args.json, raw, "\n" + table)
  return 0


def across_seeds(runs: Sequence[dict[str, Any]], systems: Sequence[str]) -> dict[str, Any]:
  """Median and range of each system's goodput over the seeds, and of the ratio (pure)."""
  out: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
  for system in systems:
    values = [r[system]["goodput"] for r in runs]
    out[system] = {"median": statistics.median(values), "min": min(values),
                   "max": max(values)}
  if "mtc" in systems and "orbax" in systems:
    ratios = [r["mtc"]["goodput"] / r["orbax"]["goodput"] for r in runs]
    out["ratio"] = {"per_seed": ratios, "median": statistics.median(ratios),
                    "min": min(ratios), "max": max(ratios)}
  return out


def _environment() -> dict[str, Any]:
  import platform

  import jax
  import orbax.checkpoint as ocp

  return {"python": platform.python_version(), "jax": jax.__version__,
          "orbax_checkpoint": ocp.__version__, "cpus": os.cpu_count(),
          "machine": platform.machine(), "time": time.time()}


if __name__ == "__main__":
  sys.exit(main())
