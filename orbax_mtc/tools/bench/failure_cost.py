"""`orbax-mtc bench failure-cost`: what one failure costs, per kind, for three systems.

The training job of `orbax-mtc bench goodput` (`goodput_train`, two data-parallel replicas)
runs under each system in turn: orbax-mtc (RAM every `--ram-seconds`, peers, persistent every
`--persistent-steps`), Orbax's emergency manager (the same two intervals, set up as MaxText
sets it up) and plain Orbax (persistent only, every `--persistent-steps`: MaxText's defaults,
`checkpoint_period: 10_000`, `local_checkpoint_period: 0`). Every system saves step 0 as
MaxText does, and an on-demand checkpoint on SIGTERM. The RAM interval is given in seconds of
training and converted to steps with the step time measured by a short calibration job.

Each job run takes one failure, then the job is restarted as a scheduler would, in this order:

- `sigkill`: one process SIGKILLed (the job dies).
- `wipe`: as `sigkill`, and that node's RAM folder deleted (a replaced node).
- `wipe_all`: as `sigkill`, and every node's RAM folder deleted (only persistent storage left).
- `sigterm`: SIGTERM to one process (maintenance: on-demand save, then the job stops).

A SIGKILL lands a seeded number of steps after a RAM-interval boundary, past the first RAM
save after step 0 (so a RAM tier has something newer than the persistent step 0); a SIGTERM a
seeded 5-24 steps into its run. Per failure: work lost = (last step reached - step restored) x
the median step time, and recovery = seconds from the failure to the first step after the
restart. Restores from the persistent tier lose everything since step 0 here, which depends on
the run's length; the report gives, computed and marked as such, what that costs at the
persistent interval (half an interval on average).
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbax_mtc.tools.bench import goodput, output

KINDS = ("sigkill", "wipe", "wipe_all", "sigterm")  # the order within one job
SYSTEMS = ("mtc", "emergency", "orbax")
SCHEMA = "orbax-mtc/bench-failure-cost/1"
KIND_LABELS = {"sigkill": "one process SIGKILLed", "wipe": "one node's RAM lost",
               "wipe_all": "all RAM lost", "sigterm": "SIGTERM (maintenance)"}
_PLOT_LABELS = {"sigkill": "1 process\nSIGKILLed", "wipe": "1 node's\nRAM lost",
                "wipe_all": "all RAM\nlost", "sigterm": "SIGTERM\n(maintenance)"}
SYSTEM_LABELS = {"mtc": "orbax-mtc", "emergency": "Orbax emergency", "orbax": "plain Orbax"}
MAXTEXT_CHECKPOINT_PERIOD = 10_000  # MaxText's base.yml `checkpoint_period`
_JOB_TIMEOUT_S = 900.0


@dataclasses.dataclass
class PlannedFailure(goodput.Failure):
  """A failure placed relative to its run: `offset` steps past a RAM-interval boundary
  (`sigterm`: past the restored step); `at_step` is set when the run's first step is seen."""

  offset: int = 0


def make_plan(seed: int, ram_steps: int, nprocs: int,
              kinds: Sequence[str] = KINDS) -> list[PlannedFailure]:
  """One failure of each kind, in `KINDS` order, with seeded offsets and nodes (pure)."""
  rng = random.Random(seed)
  out = []
  for kind in KINDS:
    offset = rng.randrange(5, 25) if kind == "sigterm" else rng.randrange(1, ram_steps)
    node = rng.randrange(nprocs)
    if kind in kinds:
      out.append(PlannedFailure(kind=kind, at_step=-1, node=node, offset=offset))
  return out


def target_step(failure: PlannedFailure, restored: int, ram_steps: int) -> int:
  """The step at which `failure` is injected in a run restored at `restored` (pure)."""
  if failure.kind == "sigterm":
    return restored + failure.offset
  step = max(restored, ram_steps) // ram_steps * ram_steps + failure.offset
  return step if step > restored else step + ram_steps


def costs(events: list[dict], failures: Sequence[goodput.Failure]) -> dict[str, Any]:
  """Per failure: steps and seconds of work lost, restored tier, recovery seconds (pure)."""
  out = goodput.summarize(events, list(failures), steps=0, wall_s=0.0)
  step_s = out["median_step_s"]
  per = []
  for f in out["failures"]:
    lost = f["steps_lost"]
    per.append({**f, "work_lost_s": None if lost is None else lost * step_s})
  return {"median_step_s": step_s, "failures": per, "runs": out["runs"],
          "steps_executed": out["steps_executed"]}


def across_seeds(runs: Sequence[dict[str, Any]], systems: Sequence[str],
                 kinds: Sequence[str]) -> dict[str, Any]:
  """Median, min and max over the seeds of each (kind, system)'s work lost and recovery,
  and the tiers restored from (pure)."""
  out: dict[str, Any] = {}
  for kind in kinds:
    row: dict[str, Any] = {}
    for system in systems:
      found = [f for r in runs for f in r[system]["failures"] if f["kind"] == kind]
      cell: dict[str, Any] = {"tiers": sorted({str(f["restored_tier"]) for f in found}),
                              "hung": sum(bool(f.get("hung")) for f in found),
                              "runs": len(found)}
      for name in ("work_lost_s", "recovery_s", "steps_lost"):
        values = [f[name] for f in found if f[name] is not None]
        cell[name] = ({"median": statistics.median(values), "min": min(values),
                       "max": max(values), "n": len(values)} if values else None)
      row[system] = cell
    out[kind] = row
  return out


def _seconds(spread: dict[str, float] | None) -> str:
  if spread is None:
    return "-"
  if spread["n"] == 1 or round(spread["min"], 1) == round(spread["max"], 1):
    return f"{spread['median']:.1f}"
  return f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"


def _since_zero(cell: dict[str, Any]) -> bool:
  """Whether a (kind, system) lost work back to a persistent step (step 0 in this run)."""
  lost = cell["steps_lost"]
  return bool(lost and lost["max"] > 0) and bool({"persistent", "none"} & set(cell["tiers"]))


def markdown(summary: dict[str, Any], meta: dict[str, Any], systems: Sequence[str],
             kinds: Sequence[str]) -> str:
  """The table of medians (min-max) over the seeds, and the notes that go with it (pure)."""
  step_s = meta["step_s"]
  lines = [f"What one failure costs: {meta['procs']} processes (2 replicas), {meta['mib']} MiB "
           f"per process, step {1e3 * step_s:.0f} ms (measured); RAM every "
           f"{meta['ram_seconds']:g} s = {meta['ram_steps']} steps (orbax-mtc, emergency), "
           f"persistent every {meta['persistent_steps']} steps (all); seeds "
           f"{', '.join(str(s) for s in meta['seeds'])}; seconds, median (min-max)", "",
           "| failure | " + " | ".join(f"{SYSTEM_LABELS[s]}: work lost | {SYSTEM_LABELS[s]}: "
                                       "failure -> first step" for s in systems) + " |",
           "|---" * (1 + 2 * len(systems)) + "|"]
  for kind in kinds:
    cells = []
    for system in systems:
      cell = summary[kind][system]
      back = _seconds(cell["recovery_s"])
      if cell["recovery_s"] and cell["recovery_s"]["n"] < len(meta["seeds"]):
        back += f" [{cell['recovery_s']['n']} seed]"
      if cell["hung"]:
        back = (f"no step ({cell['hung']} of {cell['runs']})" if back == "-" else
                f"{back}; no step in {cell['hung']} of {cell['runs']}")
      cells += [_seconds(cell["work_lost_s"]) + (" *" if _since_zero(cell) else ""), back]
    lines.append(f"| {KIND_LABELS[kind]} | " + " | ".join(cells) + " |")
  lines.append("")
  for system in systems:
    tiers = ", ".join(f"{KIND_LABELS[k]}: {'/'.join(summary[k][system]['tiers']) or 'not run'}"
                      for k in kinds)
    lines.append(f"- {SYSTEM_LABELS[system]} restored from: {tiers}")
  if any(summary[k][s]["hung"] for k in kinds for s in systems):
    lines.append(f"- no step: the restarted job made no training step within "
                 f"{meta['hang_seconds']:g} s (it hung); it was killed and that system's "
                 "later failures were not run for that seed.")
  half = meta["persistent_steps"] / 2 * step_s
  lines.append(f"- \\* restored from the persistent tier, whose last save in this short run is "
               f"step 0: the figure is the run's length before the failure. At a "
               f"{meta['persistent_steps']}-step persistent interval the loss is on average "
               f"half an interval: {meta['persistent_steps'] // 2} steps x "
               f"{1e3 * step_s:.0f} ms = {half:.0f} s (computed, not measured), at most "
               f"{2 * half:.0f} s.")
  return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], systems: Sequence[str], kinds: Sequence[str],
         path: Path) -> bool:
  """Bars of work lost and recovery per failure kind and system; False without matplotlib."""
  from orbax_mtc.tools.bench import plotting

  plt = plotting.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  width = 0.8 / len(systems)
  for ax, name, title in ((axes[0], "work_lost_s", "work lost (s)"),
                          (axes[1], "recovery_s", "failure -> first step (s)")):
    for i, system in enumerate(systems):
      cells = [summary[k][system][name] for k in kinds]
      med = [c["median"] if c else 0.0 for c in cells]
      err = [[m - (c["min"] if c else 0.0) for m, c in zip(med, cells, strict=True)],
             [(c["max"] if c else 0.0) - m for m, c in zip(med, cells, strict=True)]]
      xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(kinds))]
      bars = ax.bar(xs, med, width, yerr=err, capsize=2, label=SYSTEM_LABELS[system],
                    color=f"C{i}")
      if name == "work_lost_s":  # hatched: back to persistent step 0, i.e. the run's length
        for bar, kind in zip(bars, kinds, strict=True):
          bar.set_hatch("//" if _since_zero(summary[kind][system]) else "")
      ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(kinds)), [_PLOT_LABELS[k] for k in kinds], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
  axes[0].legend([plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(systems))],
                 [SYSTEM_LABELS[s] for s in systems], fontsize=8)
  fig.suptitle("What one failure costs (median over seeds, whiskers: min-max; hatched: back "
               "to persistent step 0, so the run's length)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _train_command(system: str, args, base: Path, run: int, ram_steps: int,
                   extra: list[str]) -> list[str]:
  return [sys.executable, "-m", "orbax_mtc.tools.bench.goodput_train", "--system", system,
          "--persistent-dir", str(base / "persistent"), "--report", str(base / "report.jsonl"),
          "--run", str(run), "--steps", str(10**9), "--work", str(args.work),
          "--mib", str(args.mib), "--min-step-ms", str(args.min_step_ms),
          "--local-every", str(ram_steps), "--persistent-every", str(args.persistent_steps),
          "--replicas", "2", *extra]


def _events(base: Path) -> list[dict]:
  report = base / "report.jsonl"
  if not report.exists():
    return []
  return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


def calibrate(args, root: Path) -> float:
  """Median step time of the job (plain Orbax, no saves) over `--calibration-steps`."""
  from orbax_mtc.tools import launch

  base = root / "calibration"
  shutil.rmtree(base, ignore_errors=True)
  (base / "persistent").mkdir(parents=True)
  steps = args.calibration_steps
  command = _train_command("orbax", args, base, 1, 1, ["--extra-steps", str(steps)])
  command[command.index("--persistent-every") + 1] = str(10**9)
  job = launch.Job(command, args.procs, devices_per_process=1, local_root=base / "local",
                   env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=goodput._Watch())
  with job.start():
    result = job.wait(timeout_s=_JOB_TIMEOUT_S)
  if result.returncode != 0:
    raise RuntimeError(f"calibration job failed with status {result.returncode}")
  compute = [e["compute_s"] for e in _events(base) if e["event"] == "step"][3:]  # compiled
  shutil.rmtree(base, ignore_errors=True)
  return statistics.median(compute)


def run_job(system: str, args, plan: Sequence[PlannedFailure], ram_steps: int,
            root: Path) -> dict[str, Any]:
  """One job under `system`: one failure per run, restarted after each (as a scheduler
  would), then `--after-steps` steps past the last restore."""
  from orbax_mtc.tools import launch

  base = root / system
  shutil.rmtree(base, ignore_errors=True)
  (base / "persistent").mkdir(parents=True)
  failures = [dataclasses.replace(f) for f in plan]
  started = time.time()
  hung = False
  for run in range(1, len(failures) + 2):
    failure = failures[run - 1] if run <= len(failures) else None
    extra = ["--save-step-zero"] + (
        [] if failure else ["--extra-steps", str(args.after_steps)])
    watch = goodput._Watch()
    job = launch.Job(_train_command(system, args, base, run, ram_steps, extra), args.procs,
                     devices_per_process=1, local_root=base / "local",
                     env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=watch)
    with job.start():
      begun = time.monotonic()
      deadline = begun + _JOB_TIMEOUT_S
      while not job.poll():
        if time.monotonic() > deadline:
          raise RuntimeError(f"{system}: run {run} timed out:\n" + "\n".join(watch.tail))
        with watch.cond:
          watch.cond.wait(timeout=0.5)  # woken by output; the timeout notices exits
          first, reached = watch.first_step, watch.max_step
        if first is None and run > 1 and time.monotonic() - begun > args.hang_seconds:
          hung = True  # no step after the restart: the job is left here (killed on exit)
          break
        if failure is None or failure.injected_at is not None or first is None:
          continue
        if failure.at_step < 0:
          failure.at_step = target_step(failure, first - 1, ram_steps)
        if reached >= failure.at_step:
          failure.injected_at, failure.run = time.time(), run
          os.kill(job.pids[failure.node],
                  signal.SIGTERM if failure.kind == "sigterm" else signal.SIGKILL)
      if not hung:
        job.wait(timeout_s=_JOB_TIMEOUT_S)
    if hung:
      print(f"   {system}: run {run} made no step in {args.hang_seconds:g} s after the "
            f"restart; the remaining failures are not run",
            file=output.text(getattr(args, "json", False)), flush=True)
      break
    if failure is not None and failure.injected_at is None:
      raise RuntimeError(f"{system}: run {run} ended before its {failure.kind}:\n"
                         + "\n".join(watch.tail))
    if failure is not None and failure.kind in ("wipe", "wipe_all"):
      nodes = range(args.procs) if failure.kind == "wipe_all" else [failure.node]
      for node in nodes:
        shutil.rmtree(job.local_directory(node), ignore_errors=True)
  events = _events(base)
  if not hung and not any(e["event"] == "done" and e["run"] == len(failures) + 1
                          for e in events):
    raise RuntimeError(f"{system}: the last run did not finish:\n" + "\n".join(watch.tail))
  shutil.rmtree(base, ignore_errors=True)
  out = costs(events, failures)
  for f in out["failures"]:
    f["hung"] = f["recovery_s"] is None  # no step after its restart
  out.update(system=system, hung=hung, wall_s=time.time() - started,
             plan=[dataclasses.asdict(f) for f in failures])
  return out


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="orbax-mtc bench failure-cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--procs", type=int, default=4,
                 help="processes of the job, even and >= 2 (default: %(default)s)")
  p.add_argument("--mib", type=int, default=16, help="state MiB per process (default: 16)")
  p.add_argument("--work", type=int, default=1,
                 help="256x256 matmuls per training step (default: %(default)s)")
  p.add_argument("--min-step-ms", type=float, default=100.0,
                 help="pad each step to this long (device time) (default: %(default)s)")
  p.add_argument("--ram-seconds", type=float, default=60.0,
                 help="RAM-tier interval of orbax-mtc and the emergency manager, in seconds "
                 "of training (default: %(default)s)")
  p.add_argument("--persistent-steps", type=int, default=MAXTEXT_CHECKPOINT_PERIOD,
                 help="persistent interval of all three, in steps (default: MaxText's "
                 "checkpoint_period, %(default)s)")
  p.add_argument("--calibration-steps", type=int, default=40,
                 help="steps timed to convert --ram-seconds (default: %(default)s)")
  p.add_argument("--after-steps", type=int, default=5,
                 help="steps trained after the last restart (default: %(default)s)")
  p.add_argument("--hang-seconds", type=float, default=150.0,
                 help="a restarted job with no step after this long is taken as hung: "
                 "killed, and that system's later failures skipped (default: %(default)s)")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                 help="failure plans, one job per system each (default: 0 1)")
  p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
  p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                 help="failure kinds, run in the order sigkill, wipe, wipe_all, sigterm")
  p.add_argument("--out", default="failure-cost-results",
                 help="folder for failure-cost.json/.md/.png (default: %(default)s)")
  p.add_argument("--scratch", default=None,
                 help="folder for both tiers while running, removed afterwards "
                 "(default: /dev/shm/orbax-mtc-failure-cost-<pid>)")
  output.add_json_flag(p, SCHEMA)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.procs < 2 or args.procs % 2:
    parser.error("--procs must be even and >= 2: the emergency manager needs two "
                     "data-parallel replicas.")
  kinds = [k for k in KINDS if k in args.kinds]
  scratch = Path(args.scratch or f"/dev/shm/orbax-mtc-failure-cost-{os.getpid()}")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  text = output.text(args.json)
  runs: list[dict[str, Any]] = []
  try:
    step_s = calibrate(args, scratch)
    ram_steps = max(2, round(args.ram_seconds / step_s))
    print(f"== step {1e3 * step_s:.1f} ms: RAM every {ram_steps} steps, persistent every "
          f"{args.persistent_steps}", file=text, flush=True)
    for seed in args.seeds:
      plan = make_plan(seed, ram_steps, args.procs, kinds)
      results: dict[str, Any] = {"seed": seed}
      for system in args.systems:
        print(f"== seed {seed}, {system}: {[(f.kind, f.offset, f.node) for f in plan]}",
              file=text, flush=True)
        r = results[system] = run_job(system, args, plan, ram_steps, scratch)
        for f in r["failures"]:
          back = "none" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s after"
          print(f"   {f['kind']}: {f['steps_lost']} steps lost ({f['work_lost_s']} s, "
                f"from {f['restored_tier']}), first step: {back}", file=text, flush=True)
      runs.append(results)
      table, raw = _write(out, runs, args, kinds, step_s, ram_steps)  # after each seed
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  output.emit(args.json, raw, "\n" + table)
  return 0


def _write(out: Path, runs: list[dict[str, Any]], args, kinds: Sequence[str], step_s: float,
           ram_steps: int) -> tuple[str, dict[str, Any]]:
  """Writes failure-cost.json/.md/.png for the seeds run so far; returns the table and the
  document."""
  summary = across_seeds(runs, args.systems, kinds)
  meta = {"procs": args.procs, "mib": args.mib, "step_s": step_s, "ram_steps": ram_steps,
          "ram_seconds": args.ram_seconds, "persistent_steps": args.persistent_steps,
          "hang_seconds": args.hang_seconds, "seeds": [r["seed"] for r in runs]}
  table = markdown(summary, meta, args.systems, kinds)
  raw = {"schema": SCHEMA, "runs": runs, "summary": summary, "meta": meta, "args": vars(args),
         "environment": goodput._environment()}
  (out / "failure-cost.json").write_text(json.dumps(raw, indent=1))
  (out / "failure-cost.md").write_text(table)
  if not plot(summary, args.systems, kinds, out / "failure-cost.png"):
    print("no plot: matplotlib is not installed", file=sys.stderr)
  return table, raw


if __name__ == "__main__":
  sys.exit(main())
