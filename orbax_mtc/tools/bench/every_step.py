"""`orbax-mtc bench every-step`: training-loop overhead of RAM saves every N steps and
continuously, against the same loop without checkpointing in the same run.

  orbax-mtc bench every-step [--mib 256 1024] [--procs 1 2] [--every 1 5 20] [--json]

For each process count, one job of real JAX processes (one device each on JAX's default
backend, jax.distributed on localhost, RAM folders under /dev/shm) runs `every_step_worker`
over every size. A step is `--idle-ms` of idle host time (standing for the accelerator's
compute) plus a jitted update of the whole state, donated. Each repetition runs, for every
variant (`every N` for each N of `--every`, then `continuous`: Orbax's
`ContinuousCheckpointingPolicy` on the RAM tier, and with `--budget` the same with
`LocalCheckpointOptions.save_overhead_budget`), a baseline loop without a manager and right
after it the loop with one; with 2 or more processes every node's step also goes to its peer.
Per variant (slowest process, medians over repetitions): loop time, overhead against the
baseline of the same repetition, save() blocking p50 and p99, the saves made, the achieved
interval between saves (steps and seconds) and how long after its save a step's copies were
out to its peer. Markdown table on stdout; with `--json`, one JSON document
(`orbax-mtc/bench-every-step/1`) on stdout instead and the table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from orbax_mtc.tools import console
from orbax_mtc.tools.bench import output

SCHEMA = "orbax-mtc/bench-every-step/1"
_MARK = "@@every-step "
_PROGRESS = "@@progress "


class _Output:
  """Collects the job's output; relays the worker's progress lines to stderr."""

  def __init__(self, quiet: bool):
    self.lock = threading.Lock()
    self.text = ""
    self.quiet = quiet

  def write(self, text: str) -> None:
    with self.lock:
      self.text += text
    if not self.quiet and _PROGRESS in text:
      sys.stderr.write(text.split(_PROGRESS, 1)[1])
      sys.stderr.flush()

  def flush(self) -> None:
    pass


def run_job(procs: int, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
  """One job of `procs` processes over every size; the records process 0 printed."""
  from orbax_mtc.tools import launch

  shutil.rmtree(root, ignore_errors=True)
  out = _Output(args.quiet)
  command = [sys.executable, "-m", "orbax_mtc.tools.bench.every_step_worker",
             "--mib", *map(str, args.mib), "--every", *map(str, args.every),
             "--continuous", "off" if args.no_continuous else "on",
             *(["--budget", str(args.budget)] if args.budget is not None else []),
             *(["--chunk-mib", str(args.chunk_mib)] if args.chunk_mib is not None else []),
             "--steps", str(args.steps), "--reps", str(args.reps),
             "--warm-saves", str(args.warm_saves),
             "--idle-ms", str(args.idle_ms), "--donate", "off" if args.no_donate else "on",
             "--idle", "before-save" if args.idle_before_save else "after-save",
             "--sync", "on" if args.sync_step else "off",
             "--background-nice", str(args.background_nice),
             "--persistent", str(root / "persistent")]
  try:
    with launch.Job(command, procs, devices_per_process=1, local_root=root / "local",
                    env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=out).start() as job:
      result = job.wait(timeout_s=args.timeout)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if result.returncode != 0:
    raise RuntimeError(f"{procs}-process job exited {result.returncodes}"
                       f"{' (timed out)' if result.timed_out else ''}:\n{out.text[-4000:]}")
  records = [json.loads(line.split(_MARK, 1)[1]) for line in out.text.splitlines()
             if _MARK in line]
  if len(records) != len(args.mib):
    raise RuntimeError(f"{procs}-process job reported {len(records)} of {len(args.mib)} "
                       f"sizes:\n{out.text[-4000:]}")
  return records


def _median(values: list[float | None]) -> float | None:
  kept = [v for v in values if v is not None]
  return statistics.median(kept) if kept else None


def _ms(value: float | None) -> float | None:
  return None if value is None else 1000 * value


def summarize(record: dict[str, Any]) -> list[dict[str, Any]]:
  """Per variant, medians over the repetitions (pure); overhead is paired per repetition."""
  rows = []
  names = list(dict.fromkeys(run["name"] for run in record["runs"]))
  steps = record["steps"]
  for name in names:
    runs = [run for run in record["runs"] if run["name"] == name]

    def med(key: str, runs: list = runs) -> float | None:
      return _median([run["variant"][key] for run in runs])

    overheads = [100 * (run["variant"]["loop_s"] - run["baseline"]["loop_s"])
                 / run["baseline"]["loop_s"] for run in runs]
    in_save = med("in_save_s")

    def extra_ms(key: str, runs: list = runs) -> float | None:
      """Per step, the variant's `key` over its baseline's (median over repetitions)."""
      deltas = [1000 * (run["variant"][key] - run["baseline"][key]) / steps for run in runs
                if run["variant"].get(key) is not None and run["baseline"].get(key) is not None]
      return _median(deltas)

    rows.append({
        "variant": name, "every": runs[0]["every"], "reps": len(runs),
        "loop_s": med("loop_s"), "baseline_s": _median([r["baseline"]["loop_s"] for r in runs]),
        "overhead_pct": _median(overheads), "overhead_pct_min": min(overheads),
        "overhead_pct_max": max(overheads),
        "save_p50_ms": _ms(med("save_p50_s")), "save_p99_ms": _ms(med("save_p99_s")),
        "save_max_ms": _ms(med("save_max_s")),
        "saving_call_p50_ms": _ms(med("saving_p50_s")),
        "in_save_ms_per_step": None if in_save is None else 1000 * in_save / steps,
        "update_extra_ms_per_step": extra_ms("update_sum_s"),
        "sleep_extra_ms_per_step": extra_ms("sleep_sum_s"),
        "update_p50_ms": _ms(med("update_p50_s")),
        # Updates dispatched while this process's chunks still moved (they wait for them on a
        # CPU client), and what they took beyond the others, per step.
        "updates_behind_chunks": _median([run["variant"].get("behind_chunks")
                                          for run in runs]),
        "behind_chunks_ms_per_step": _median(
            [1000 * run["variant"]["behind_chunks_extra_s"] / steps for run in runs
             if run["variant"].get("behind_chunks_extra_s") is not None]),
        "saves": med("saves"), "interval_steps": med("interval_steps"),
        "interval_s": med("interval_s"), "peer_copy_out_s": med("protected_s"),
        "peer_copy_out_steps": med("protected_steps"), "backups": med("backups"),
    })
  return rows


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
  return "-" if value is None else f"{value:{spec}}{unit}"


def markdown(results: list[dict[str, Any]], config: dict[str, Any]) -> str:
  """The table of every (procs, size, variant) row (pure)."""
  lines = [
      f"{config['steps']} timed steps of a jitted update of the whole state "
      f"({'donated' if config.get('donate', True) else 'not donated'}"
      f"{', with a cross-process all-reduce' if config.get('sync_step') else ''}), save() and "
      f"{config['idle_ms']:g} ms idle ({config.get('idle', 'after-save')}); "
      f"medians of {config['reps']} repetitions, slowest process; "
      + (f"the RAM tier's background threads at nice +{config['background_nice']}; "
         if config.get("background_nice") is not None else "") +
      "overhead against the baseline loop (no manager) run right before, same repetition. "
      "Per step: the time inside save(), and what the update and the idle sleep took beyond "
      "the baseline's (the update waits for a donated buffer a save still reads; a sleeper "
      "wakes late on a busy host).",
      "",
      "| procs | MiB/proc | arrays on | variant | loop (baseline) | overhead (min..max) | "
      "save() p50 / p99 | per step: in save(), update +, sleep + | saves | "
      "interval: steps / s | copy on peer after |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for result in results:
    for row in result["summary"]:
      interval = ("-" if row["interval_steps"] is None else
                  f"{row['interval_steps']:g} / {row['interval_s']:.2f} s")
      peer = ("-" if row["peer_copy_out_s"] is None else
              f"{row['peer_copy_out_s']:.2f} s ({row['peer_copy_out_steps']:g} "
              f"step{'' if row['peer_copy_out_steps'] == 1 else 's'})")
      lines.append(
          f"| {result['procs']} | {result['mib']} | {result['backend']} | {row['variant']} | "
          f"{_fmt(row['loop_s'], '.2f', ' s')} ({_fmt(row['baseline_s'], '.2f', ' s')}) | "
          f"{_fmt(row['overhead_pct'], '+.1f', ' %')} "
          f"({_fmt(row['overhead_pct_min'], '+.1f')}..{_fmt(row['overhead_pct_max'], '+.1f')}) | "
          f"{_fmt(row['save_p50_ms'], '.1f')} / {_fmt(row['save_p99_ms'], '.1f', ' ms')} | "
          f"{_fmt(row['in_save_ms_per_step'], '.1f')}, "
          f"{_fmt(row['update_extra_ms_per_step'], '+.1f')}, "
          f"{_fmt(row['sleep_extra_ms_per_step'], '+.1f', ' ms')} | {_fmt(row['saves'], 'g')} | "
          f"{interval} | {peer} |")
  return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc bench every-step",
      description="Training-loop overhead of RAM saves every N steps and continuously "
      "(Orbax's ContinuousCheckpointingPolicy), against the same loop without checkpointing "
      "in the same run.")
  parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024],
                      help="state MiB per process, one series each (default: 256 1024)")
  parser.add_argument("--procs", type=int, nargs="+", default=[1, 2],
                      help="process counts, one job each; 2 or more send every node's step to "
                      "its peer (default: 1 2)")
  parser.add_argument("--every", type=int, nargs="*", default=[1, 5, 20],
                      help="local save intervals in steps, one variant each (default: 1 5 20)")
  parser.add_argument("--no-continuous", action="store_true",
                      help="skip the continuous variant (default: run it)")
  parser.add_argument("--budget", type=float, default=None, metavar="FRACTION",
                      help="also run the continuous policy with LocalCheckpointOptions."
                      "save_overhead_budget=FRACTION, e.g. 0.02 (default: not run)")
  parser.add_argument("--chunk-mib", type=int, default=None,
                      help="ReplicationOptions.chunk_mib of the peer copies (default: its "
                      "default)")
  parser.add_argument("--steps", type=int, default=40,
                      help="timed steps per loop (default: %(default)s)")
  parser.add_argument("--warm-saves", type=int, default=3, metavar="N",
                      help="saves each manager makes, each waited for, before its timed "
                      "steps: steady state, its files reused (the peer copies reuse one from "
                      "the third on) (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=3,
                      help="repetitions; the table gives medians (default: %(default)s)")
  parser.add_argument("--idle-ms", type=float, default=200.0,
                      help="idle host time per step, standing for accelerator compute "
                      "(default: %(default)s)")
  parser.add_argument("--no-donate", action="store_true",
                      help="do not donate the state to the update (a new buffer each step; "
                      "shows what reusing buffers costs) (default: donate)")
  parser.add_argument("--idle-before-save", action="store_true",
                      help="order a step update, idle, save instead of update, save, idle: the "
                      "next update then donates the buffer the save just handed to its writer "
                      "(default: idle after the save, as while an accelerator computes)")
  parser.add_argument("--sync-step", action="store_true",
                      help="the update also all-reduces a scalar across the processes and "
                      "waits for it, as a data-parallel step does; the baseline too (default: "
                      "no cross-process collective in the step)")
  parser.add_argument("--background-nice", type=int, default=10, metavar="N",
                      help="LocalCheckpointOptions.background_nice: how much lower the RAM "
                      "tier's background threads run than the loop, 0-19 (default: "
                      "%(default)s, the option's default; 0: the process's priority)")
  parser.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds one job may run before it is killed (default: %(default)s)")
  output.add_json_flag(parser, SCHEMA)
  parser.add_argument("--quiet", action="store_true",
                      help="no progress lines on stderr (default: off)")
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  for name in ("mib", "procs"):
    if any(v < 1 for v in getattr(args, name)):
      parser.error(f"--{name} values must be >= 1")
  if any(v < 1 for v in args.every) or args.steps < 1 or args.reps < 1 or args.idle_ms < 0:
    parser.error("--every, --steps and --reps must be >= 1 and --idle-ms >= 0")
  if not args.every and args.no_continuous:
    parser.error("nothing to measure: no --every interval and --no-continuous")
  if args.chunk_mib is not None and args.chunk_mib < 1:
    parser.error("--chunk-mib must be >= 1")
  if args.warm_saves < 0:
    parser.error("--warm-saves must be >= 0")
  if args.budget is not None and (args.no_continuous or not 0 < args.budget <= 1):
    parser.error("--budget takes a fraction in (0, 1] and needs the continuous variant")
  if not 0 <= args.background_nice <= 19:
    parser.error("--background-nice must be in 0-19")
  if threading.current_thread() is threading.main_thread():
    # A SIGTERM to this driver unwinds it like Ctrl-C, so the job's processes are killed
    # (launch.Job's context) and their RAM folders removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
  root = base / f"orbax-mtc-every-step-{os.getpid()}"
  results = []
  try:
    for procs in args.procs:
      for record in run_job(procs, args, root):
        record["summary"] = summarize(record)
        results.append(record)
  except RuntimeError as e:
    console.error("orbax-mtc bench every-step", str(e))
    return 1
  config = {"mib": args.mib, "procs": args.procs, "every": args.every,
            "continuous": not args.no_continuous, "budget": args.budget,
            "chunk_mib": args.chunk_mib,
            "steps": args.steps, "reps": args.reps, "warm_saves": args.warm_saves,
            "idle_ms": args.idle_ms, "donate": not args.no_donate,
            "idle": "before-save" if args.idle_before_save else "after-save",
            "sync_step": args.sync_step, "background_nice": args.background_nice}
  table = markdown(results, config)
  output.emit(args.json, {
      "schema": SCHEMA, "config": config,
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "python": platform.python_version(),
                  "jax_platforms": os.environ.get("JAX_PLATFORMS")},
      "results": results}, table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
