"""`orbax-mtc bench suite`: orbax-mtc beside the machine's limits and Orbax, in one run.

For each process count (`--procs`), one job of that many real JAX processes (one CPU device
each, jax.distributed on localhost) runs `suite_worker` over every state size that fits this
machine; then, per process count and size, `--ondemand-reps` jobs are sent a real SIGTERM
(`ondemand.run_once`). Every figure is the median of `--reps` repetitions (min and max kept),
timed on the slowest process. Outputs under `--out`: `suite.json` (every raw figure, the
environment, what was skipped and why), `suite.md` (ratios: ours / limit, ours / Orbax) and
`suite.png` (bandwidth vs state size; needs matplotlib, `pip install 'orbax-mtc[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbax_mtc.tools import console
from orbax_mtc.tools.bench import output
from orbax_mtc.tools.bench.suite_report import markdown as markdown
from orbax_mtc.tools.bench.suite_report import plot as plot

SCHEMA = "orbax-mtc/bench-suite/1"  # suite.json and `--json`

# Memory and RAM disk one process needs for one size, in multiples of its state. Measured
# (`peak_rss_bytes` in suite.json, at 1 and 2 GiB, runtime excluded): one process peaks at
# about 5.8x the state in memory (the local phase and Orbax's restore), plus up to 3 state-sized
# files on the RAM disk at once (the step being written, the one it replaces, the paired raw
# file): 9x. With several processes the ring phase holds the state, its one-replica copy, a
# restore and the transport's buffers (up to 6.8x at 256 MiB) plus the node's own step and
# its peer's copy on the RAM disk: 10x.
PEAK_STATE_MULTIPLE_ONE_PROCESS = 9
PEAK_STATE_MULTIPLE_PEERS = 10
RUNTIME_BYTES_PER_PROCESS = 2**29  # Python, JAX and XLA before any state
TARGETS = {  # name: (limit, higher is better)
    "local save / raw write": (0.6, True),
    "restore / raw read": (0.6, True),
    "save blocking / memcpy": (1.25, False),
    "recovery / local restore": (1.5, False),
    "loop overhead, local save every 10 steps": (0.05, False),
}


def plan_runs(procs: Sequence[int], sizes_mib: Sequence[int],
              available_bytes: int) -> tuple[dict[int, list[int]], list[dict[str, Any]]]:
  """Which sizes each process count runs, and the combinations skipped for memory (pure)."""
  runs: dict[int, list[int]] = {}
  skipped = []
  for n in procs:
    for mib in sorted(sizes_mib):
      multiple = PEAK_STATE_MULTIPLE_ONE_PROCESS if n == 1 else PEAK_STATE_MULTIPLE_PEERS
      need = n * (mib * 2**20 * multiple + RUNTIME_BYTES_PER_PROCESS)
      if need <= available_bytes:
        runs.setdefault(n, []).append(mib)
      else:
        skipped.append({"procs": n, "mib": mib, "why": (
            f"needs about {need / 2**30:.1f} GiB of memory and RAM disk "
            f"({multiple}x the state and 0.5 GiB per process), "
            f"{available_bytes / 2**30:.1f} GiB available")})
  return runs, skipped


def available_memory() -> int:
  """Bytes both free in memory and on /dev/shm (the RAM disk lives in memory), less 10 %."""
  avail = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          avail = int(line.split()[1]) * 1024
  except OSError:
    pass
  shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
  values = [v for v in (avail, shm) if v is not None]
  return int(min(values) * 0.9) if values else 8 * 2**30


def _median(samples: Sequence[float] | None) -> float:
  return statistics.median(samples) if samples else float("nan")


def summarize(record: dict[str, Any], ondemand: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
  """Bandwidths, ratios and target checks for one (procs, size) record (pure)."""
  sec = record["seconds"]
  nbytes = record["bytes_per_process"]

  def med(key: str) -> float:
    return _median(sec.get(key))

  def gbps(key: str) -> float:
    return nbytes / med(key) / 1e9

  def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")

  def paired(ours: str, limit: str, *, bandwidth: bool) -> float | None:
    """Median over repetitions of ours against the limit taken beside it in the same
    repetition (bandwidth: the limit's seconds over ours); None if not measured in pairs."""
    a, b = sec.get(ours), sec.get(limit)
    if not a or not b or len(a) != len(b):
      return None
    return statistics.median(ratio(y, x) if bandwidth else ratio(x, y)
                             for x, y in zip(a, b, strict=True))

  out: dict[str, Any] = {"procs": record["procs"], "mib": record["mib"],
                         "bytes_per_process": nbytes}
  # On an accelerator (--fresh-state) a save must at least copy the state off the device:
  # that copy, not a host memcpy, is what its blocking time is held to.
  blocking_limit = "d2h" if "paired_d2h_s" in sec or "d2h_s" in sec else "memcpy"
  out["backend"] = record.get("backend", "cpu")
  out["device_kind"] = record.get("device_kind")
  out["blocking_limit"] = "device-to-host copy" if blocking_limit == "d2h" else "memcpy"
  for key in ("memcpy", "d2h", "raw_write_new", "raw_write_overwrite", "raw_read",
              "raw_ppermute", "raw_broadcast", "paired_memcpy", "paired_d2h",
              "paired_raw_write", "paired_raw_read",
              "mtc_save", "mtc_restore", "orbax_save", "orbax_restore", "emergency_save",
              "emergency_restore", "p2p_save", "p2p_restore"):
    if f"{key}_s" in sec:
      out[f"{key}_gbps"] = gbps(f"{key}_s")
  for key in ("memcpy", "d2h", "mtc_blocking", "orbax_blocking", "emergency_blocking",
              "p2p_blocking", "p2p_recovery", "p2p_recovery_build"):
    if f"{key}_s" in sec:
      out[f"{key}_s"] = med(f"{key}_s")
  raw_write = max(out.get("raw_write_new_gbps", float("nan")),
                  out.get("raw_write_overwrite_gbps", float("nan")))
  # Target ratios pair each of our figures with its limit from the same repetition where the
  # worker measured them so (records from before that compare the medians of the phases).
  pairs = {
      "local save / raw write": (paired("mtc_save_s", "paired_raw_write_s", bandwidth=True),
                                 ratio(out.get("mtc_save_gbps", float("nan")), raw_write)),
      "restore / raw read": (paired("mtc_restore_s", "paired_raw_read_s", bandwidth=True),
                             ratio(out.get("mtc_restore_gbps", float("nan")),
                                   out.get("raw_read_gbps", float("nan")))),
      "save blocking / memcpy": (
          paired("mtc_blocking_s", f"paired_{blocking_limit}_s", bandwidth=False),
          ratio(med("mtc_blocking_s"), med(f"{blocking_limit}_s"))),
  }
  ratios = {name: by_pairs if by_pairs is not None else by_medians
            for name, (by_pairs, by_medians) in pairs.items()}
  for layout in ("ring", "twin"):
    if f"mtc_recovery_{layout}_s" in sec:
      out[f"recovery_{layout}_s"] = med(f"mtc_recovery_{layout}_s")
      out[f"local_restore_{layout}_s"] = med(f"mtc_local_restore_{layout}_s")
      # The local restore of each repetition is taken just before its recovery.
      by_pairs = paired(f"mtc_recovery_{layout}_s", f"mtc_local_restore_{layout}_s",
                        bandwidth=False)
      ratios[f"recovery / local restore ({layout})"] = by_pairs if by_pairs is not None else \
          ratio(out[f"recovery_{layout}_s"], out[f"local_restore_{layout}_s"])
      moved = _median(sec.get(f"mtc_replication_{layout}_bytes"))
      out[f"replication_{layout}_bytes"] = moved
      out[f"replication_{layout}_s"] = med(f"mtc_replication_{layout}_s")
  if "mtc_replication_ring_s" in sec and "raw_ppermute_s" in sec:
    ring_gbps = out["replication_ring_bytes"] / out["replication_ring_s"] / 1e9
    out["replication_ring_gbps"] = ring_gbps
    ratios["replication / raw ppermute"] = ratio(ring_gbps, out["raw_ppermute_gbps"])
  if "loop_plain_s" in sec:
    plain = med("loop_plain_s")
    for key, name in (("loop_local_s", "loop overhead, local save every 10 steps"),
                      ("loop_peers_s", "loop overhead, with peers")):
      if key in sec:
        ratios[name] = med(key) / plain - 1
  for ours, theirs in (("mtc_save_gbps", "orbax_save_gbps"),
                       ("mtc_restore_gbps", "orbax_restore_gbps"),
                       ("mtc_save_gbps", "emergency_save_gbps"),
                       ("mtc_restore_gbps", "emergency_restore_gbps"),
                       ("mtc_save_gbps", "p2p_save_gbps"),
                       ("mtc_restore_gbps", "p2p_restore_gbps")):
    if ours in out and theirs in out:
      ratios[f"{ours[:-5]} / {theirs[:-5]}"] = ratio(out[ours], out[theirs])
  for theirs in ("orbax_blocking_s", "emergency_blocking_s", "p2p_blocking_s"):
    if theirs in out and "mtc_blocking_s" in out:
      ratios[f"{theirs[:-2]} / mtc_blocking"] = ratio(out[theirs], out["mtc_blocking_s"])
  # A node whose RAM folder was lost, two replicas: Orbax's P2P manager fetches its twin's
  # files over its sockets; orbax-mtc reads the twin's copy through collectives.
  if "p2p_recovery_s" in out and "recovery_twin_s" in out:
    ratios["p2p_recovery / mtc_recovery (twin)"] = ratio(out["p2p_recovery_s"],
                                                          out["recovery_twin_s"])
  out["ratios"] = ratios
  out["targets"] = {}
  for name, (limit, higher) in TARGETS.items():
    keys = [k for k in ratios if k == name or k.startswith(name + " (")]
    for key in keys:
      value = ratios[key]
      out["targets"][key] = {"value": value, "limit": limit,
                             "met": bool(value >= limit if higher else value <= limit)}
  if ondemand:
    out["ondemand_s"] = _median([r["sigterm_to_durable_s"] for r in ondemand])
    out["ondemand_parts_s"] = {k: _median([r[f"{k}_s"] for r in ondemand])
                               for k in ("notice", "agreement", "local", "peers", "persistent")}
  out["spread"] = {k: {"min": min(v), "max": max(v), "n": len(v)}
                   for k, v in sec.items() if v}
  out["notes"] = record.get("notes", {})
  return out


def _no_nan(value: Any) -> Any:
  """NaN (a figure not measured) as null, so the JSON is strict."""
  if isinstance(value, float) and value != value:
    return None
  if isinstance(value, dict):
    return {k: _no_nan(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_no_nan(v) for v in value]
  return value


class _Collect:
  def __init__(self, echo: bool, bar: Any = None, file: Any = None):
    self.text = ""
    self.echo = echo
    self.bar = bar  # a tqdm advanced once per size measured
    self.file = file  # where progress lines go (stderr under --json)

  def write(self, text: str) -> int:
    self.text += text
    if "@@suite" in text:
      if self.bar is not None:
        self.bar.update(1)
      if self.echo:
        line = f"  measured {json.loads(text.split('@@suite ', 1)[1])['mib']} MiB"
        _say(line, self.bar, self.file)
    return len(text)

  def flush(self) -> None:
    pass


def _say(line: str, bar: Any = None, file: Any = None) -> None:
  """Prints a line (to stdout by default) above the progress bar, if one is drawn."""
  file = sys.stdout if file is None else file
  if bar is None:
    print(line, file=file, flush=True)
  else:
    bar.write(line, file=file)
    file.flush()


def _run_job(args, n: int, sizes: list[int], scratch: Path, bar: Any = None,
             contenders: Sequence[str] = ()) -> tuple[list[dict[str, Any]], str | None]:
  """Runs one job of `contenders` for every size; returns its records and why it failed
  (None: it did not)."""
  from orbax_mtc.tools import launch

  persistent = scratch / "persistent"
  shared = scratch / "shared"
  for folder in (persistent, shared):
    folder.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, "-m", "orbax_mtc.tools.bench.suite_worker",
             "--sizes", *map(str, sizes), "--reps", str(args.reps),
             "--persistent", str(persistent), "--shared-local", str(shared),
             "--loop-steps", str(args.loop_steps), "--save-every", str(args.save_every),
             "--step-ms", str(args.step_ms), "--contenders", *contenders,
             "--fresh-state", args.fresh_state]
  out = _Collect(echo=not args.quiet, bar=bar, file=output.text(args.json))
  try:
    result = launch.run_processes(command, n, devices_per_process=1,
                                  local_root=scratch / "local",
                                  env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=out,
                                  timeout_s=args.timeout_s)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  records = [json.loads(line.split("@@suite ", 1)[1]) for line in out.text.splitlines()
             if "@@suite " in line]
  failure = None
  if result.returncode != 0 or len(records) != len(sizes):
    killed = " (SIGKILL: out of memory or --timeout-s)" if 137 in result.returncodes else ""
    failure = f"the job failed with exit {result.returncodes}{killed}"
    _say(f"suite job ({' '.join(contenders)}) with {n} processes: {failure}\n"
         + out.text[-4000:], bar, sys.stderr)
  return records, failure


def job_plan(contenders: Sequence[str]) -> list[list[str]]:
  """The jobs one process count runs (pure): Orbax's P2P manager in a job of its own, right
  after the others, so that its TCP service and threads never share a process with another
  contender."""
  others = [c for c in contenders if c != "p2p"]
  return [job for job in (others, ["p2p"] if "p2p" in contenders else []) if job]


def merge_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One record per (procs, size), the figures of every job that measured it (pure)."""
  merged: dict[tuple[int, int], dict[str, Any]] = {}
  for record in records:
    key = (record["procs"], record["mib"])
    if key not in merged:
      merged[key] = {**record, **{k: dict(record.get(k, {})) for k in (
          "seconds", "notes", "rss_bytes_after", "peak_rss_bytes")}}
      continue
    for k in ("seconds", "notes", "rss_bytes_after", "peak_rss_bytes"):
      merged[key].setdefault(k, {}).update(record.get(k, {}))
  return list(merged.values())


def _environment() -> dict[str, Any]:
  import platform

  import jax
  import orbax.checkpoint as ocp

  return {"python": platform.python_version(), "jax": jax.__version__,
          "orbax_checkpoint": ocp.__version__, "cpus": os.cpu_count(),
          "machine": platform.machine(), "platform": platform.platform(),
          "memory_available_bytes": available_memory(), "time": time.time()}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="orbax-mtc bench suite",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 2048, 4096],
                      metavar="MIB",
                      help="state MiB per process (combinations that do not fit are skipped) "
                      "(default: 64 256 1024 2048 4096)")
  parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                      help="process counts, one job each (default: 1 2 4)")
  parser.add_argument("--reps", type=int, default=5,
                      help="repetitions of each measurement; figures are medians "
                      "(default: %(default)s)")
  parser.add_argument("--ondemand-reps", type=int, default=1,
                      help="SIGTERM jobs per process count and size (0: none) "
                      "(default: %(default)s)")
  parser.add_argument("--loop-steps", type=int, default=30,
                      help="training steps of the loop-overhead figure (default: %(default)s)")
  parser.add_argument("--save-every", type=int, default=10,
                      help="local save interval, in steps, of the loop-overhead figure "
                      "(default: %(default)s)")
  parser.add_argument("--step-ms", type=float, default=200.0,
                      help="training step length in the loop-overhead figure (device time) "
                      "(default: %(default)s)")
  parser.add_argument("--contenders", nargs="+",
                      default=["limits", "orbax", "emergency", "p2p", "mtc", "loop"],
                      choices=["limits", "orbax", "emergency", "p2p", "mtc", "loop"],
                      help="what to measure: limits (memcpy, raw I/O, collectives), orbax "
                      "(plain CheckpointManager), emergency (Orbax's emergency manager), p2p "
                      "(Orbax's experimental.emergency.p2p manager), mtc, loop (train-loop "
                      "overhead) (default: all six)")
  parser.add_argument("--out", default="bench-out",
                      help="folder for suite.json/md/png (default: %(default)s)")
  parser.add_argument("--scratch", default="/dev/shm",
                      help="RAM disk under which the jobs' folders are made (and removed) "
                      "(default: %(default)s)")
  parser.add_argument("--max-memory-gib", type=float, default=None,
                      help="memory the suite may plan for (default: what is free)")
  parser.add_argument("--timeout-s", type=float, default=3600,
                      help="seconds one job may take before it is killed (default: %(default)s)")
  parser.add_argument("--fresh-state", choices=("auto", "on", "off"), default="auto",
                      help="save a fresh device copy of the state each time and hold the "
                      "save's blocking time to a device-to-host copy instead of a memcpy "
                      "(auto: on unless the arrays are on CPU) (default: %(default)s)")
  output.add_json_flag(parser, SCHEMA, also="; suite.json under --out is the same document")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress lines or bar, only the final table "
                      "(default: show progress)")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.reps < 1:
    raise SystemExit("orbax-mtc bench suite: --reps must be at least 1")
  if any(n < 1 for n in args.procs) or any(m < 1 for m in args.sizes):
    raise SystemExit("orbax-mtc bench suite: --procs and --sizes must be positive")
  from orbax_mtc.tools.bench import ondemand

  budget = int(args.max_memory_gib * 2**30) if args.max_memory_gib else available_memory()
  runs, skipped = plan_runs(args.procs, args.sizes, budget)
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  records: list[dict[str, Any]] = []
  ondemand_runs: list[dict[str, Any]] = []
  failed: list[dict[str, Any]] = []
  started = time.time()
  # One unit per size measured by each job and per on-demand job: a size whose first job
  # failed skips its on-demand jobs too, so the bar still ends at its total.
  jobs = job_plan(args.contenders)
  per_size = len(jobs) + args.ondemand_reps
  with console.progress(total=per_size * sum(len(sizes) for sizes in runs.values()),
                    desc="bench suite", unit="run", enabled=not args.quiet) as bar:
    for n, sizes in sorted(runs.items()):
      if not args.quiet:
        _say(f"{n} process(es): sizes {sizes} MiB", bar, output.text(args.json))
      measured: list[int] = []
      for i, contenders in enumerate(jobs):
        scratch = Path(tempfile.mkdtemp(prefix="orbax-mtc-suite-", dir=args.scratch))
        job_records, failure = _run_job(args, n, sizes, scratch, bar, contenders)
        records += job_records
        done = [r["mib"] for r in job_records]
        name = "" if contenders != ["p2p"] else "Orbax P2P job: "
        failed += [{"procs": n, "mib": mib, "why": name + str(failure)} for mib in sizes
                   if mib not in done]
        bar.update(max(0, len(sizes) - len(done)))
        if i == 0:
          measured = done
          bar.update(args.ondemand_reps * max(0, len(sizes) - len(done)))
      for mib in measured:
        for _ in range(args.ondemand_reps):
          root = Path(tempfile.mkdtemp(prefix="orbax-mtc-suite-ondemand-", dir=args.scratch))
          try:
            ondemand_runs.append({"procs": n, **ondemand.run_once(n, mib, root)})
          finally:
            shutil.rmtree(root, ignore_errors=True)
          bar.update(1)
  records = merge_records(records)
  rows = [summarize(r, [o for o in ondemand_runs if o["procs"] == r["procs"]
                        and o["mib"] == r["mib"]]) for r in records]
  command = "orbax-mtc bench suite " + " ".join(argv if argv is not None else sys.argv[1:])
  why_no_plot = plot(rows, out_dir / "suite.png")
  text = markdown(rows, skipped + failed, command.strip())
  if why_no_plot:
    text += f"\nNo plot: {why_no_plot}.\n"
  (out_dir / "suite.md").write_text(text)
  document = {
      "schema": SCHEMA, "args": vars(args), "environment": _environment(),
      "wall_s": time.time() - started, "skipped": skipped, "failed": failed, "runs": records,
      "ondemand": ondemand_runs, "summary": _no_nan(rows)}
  (out_dir / "suite.json").write_text(json.dumps(_no_nan(document), indent=1, allow_nan=False))
  output.emit(args.json, document, text)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
