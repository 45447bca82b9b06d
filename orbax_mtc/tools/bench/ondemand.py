"""`orbax-mtc bench ondemand`: time from SIGTERM to a durable on-demand checkpoint.

  orbax-mtc bench ondemand --mib 64 512 --procs 2 --reps 3 [--json] [--out DIR]

For each size: `--procs` real JAX processes (1 CPU device each, jax.distributed on localhost)
hold `--mib` MiB each of a state sharded over every process (one replica, so each node's
step also goes to its peer), and train (a reduction over the state per step) calling `save`
every step with `exit_after_ondemand_checkpoint=True`: RAM every 50 steps, persistent (a local
folder) never by schedule. Once every process has saved once, the driver sends a real SIGTERM
to process 0 and notes the time. Every process then saves the agreed step to RAM, peers and
the persistent tier and exits 0. Reported per size (medians of `--reps`, max over processes):
SIGTERM -> durable (the driver's kill time to the moment the last process's `ondemand.json`
says the step was durable), its fraction of 300 s, and the manager's own breakdown (agreement,
local, peers, persistent). "JAX notice" is the signal to the moment JAX's notifier (which
polls for SIGTERM once a second) posted it; "agreement" runs from there to the agreed step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from orbax_mtc.tools import console
from orbax_mtc.tools.bench import output

BUDGET_S = 300.0


def _worker(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import orbax_mtc as mtc
  from orbax_mtc import arrays, distributed

  distributed.initialize()
  n = jax.process_count()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1), ("data", "model"))
  cols = 1024
  rows = max(1, args.mib[0] * 2**20 // 4 // cols) * n
  sharding = NamedSharding(mesh, P("model"))
  w = jax.jit(lambda: jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols),
              out_shardings=sharding)()
  state = {"w": w, "step": np.int32(0)}
  abstract = arrays.abstract_tree(state)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=50, max_to_keep=1),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9),
      replication=mtc.ReplicationOptions(replica_axis="data"),
      exit_after_ondemand_checkpoint=True)
  train = jax.jit(lambda s: jnp.sum(s["w"]))
  mgr = mtc.CheckpointManager(distributed.local_directory(), args.persistent, mesh, abstract,
                              options=options)
  for step in range(1, 10**7):
    train(state).block_until_ready()
    state["step"] = np.int32(step)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    if step == 1:
      print("@@bench READY", flush=True)
  return 5  # never preempted


class _Lines:
  def __init__(self):
    self.cond = threading.Condition()
    self.text = ""

  def write(self, text):
    with self.cond:
      self.text += text
      self.cond.notify_all()

  def flush(self):
    pass


def run_once(procs: int, mib: int, root: Path) -> dict:
  """One job of `procs` processes holding `mib` MiB each; SIGTERM to process 0 once all
  saved once; the figures of the on-demand save every process then makes."""
  from orbax_mtc.tools import launch

  shutil.rmtree(root, ignore_errors=True)
  persistent = root / "persistent"
  out = _Lines()
  command = [sys.executable, "-m", "orbax_mtc.tools.bench.ondemand", "--worker", "--mib", str(mib),
             "--persistent", str(persistent)]
  with launch.Job(command, procs, devices_per_process=1, local_root=root / "local",
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"}, output=out).start() as job:
    deadline = time.monotonic() + 600
    ready = False
    while not ready and not job.poll() and time.monotonic() < deadline:
      with out.cond:  # woken by output; the timeout only lets a dead job be noticed
        ready = out.cond.wait_for(lambda: out.text.count("@@bench READY") >= procs,
                                  timeout=1.0)
    if not ready:
      raise RuntimeError("workers did not start:\n" + out.text[-3000:])
    killed_at = time.time()
    os.kill(job.pids[0], signal.SIGTERM)
    result = job.wait(timeout_s=600)
  if result.returncode != 0:
    raise RuntimeError(f"job exited {result.returncodes}:\n{out.text[-3000:]}")
  records = []
  for i in range(procs):
    node = root / "local" / f"node{i}"
    found = [p for p in node.glob("*/ondemand.json") if p.parent.name.isdigit()]
    if len(found) != 1:
      raise RuntimeError(f"node {i}: expected one ondemand.json, found {found}")
    records.append(json.loads(found[0].read_text()))
  steps = {r["step"] for r in records}
  if len(steps) != 1:
    raise RuntimeError(f"processes saved different steps: {steps}")
  durable_at = max(r["signal_time"] + r["seconds"]["total"] if r["signal_time"] else
                   float("nan") for r in records)
  parts = {k: max(r["seconds"][k] for r in records)
           for k in ("agreement", "local", "peers", "persistent")}
  shutil.rmtree(root, ignore_errors=True)
  notice_at = min(r["signal_time"] or float("nan") for r in records)
  return {"mib": mib, "step": steps.pop(), "sigterm_to_durable_s": durable_at - killed_at,
          "notice_s": notice_at - killed_at,
          **{f"{k}_s": v for k, v in parts.items()}}


SCHEMA = "orbax-mtc/bench-ondemand/1"
_PROG = "orbax-mtc bench ondemand"
_PARTS = ("sigterm_to_durable_s", "notice_s", "agreement_s", "local_s", "peers_s",
          "persistent_s")


def summarize(runs: list[dict], mibs: list[int]) -> list[dict]:
  """Per size, the median of each figure over its runs (pure)."""
  summary = []
  for mib in mibs:
    mine = [r for r in runs if r["mib"] == mib]
    summary.append({"mib": mib, **{k: statistics.median(r[k] for r in mine) for k in _PARTS}})
  return summary


def markdown(summary: list[dict], procs: int, reps: int) -> str:
  """The table of medians, one row per size (pure)."""
  lines = [f"| state per process | SIGTERM -> durable | of 300 s | JAX notice | agreement | "
           f"local | peers | persistent |  ({procs} processes, median of {reps})",
           "|---|---|---|---|---|---|---|---|"]
  for row in summary:
    lines.append(f"| {row['mib']} MiB | {row['sigterm_to_durable_s']:.2f} s | "
                 f"{100 * row['sigterm_to_durable_s'] / BUDGET_S:.1f} % | "
                 f"{row['notice_s']:.2f} s | {row['agreement_s']:.2f} s | "
                 f"{row['local_s']:.2f} s | {row['peers_s']:.2f} s | "
                 f"{row['persistent_s']:.2f} s |")
  return "\n".join(lines)


def document(procs: int, reps: int, runs: list[dict], summary: list[dict]) -> dict:
  """The --json document (docs/cli.md: orbax-mtc/bench-ondemand/1)."""
  return {"schema": SCHEMA, "procs": procs, "reps": reps, "budget_s": BUDGET_S, "runs": runs,
          "summary": summary}


def _driver(args) -> int:
  as_json = args.json is True
  text = output.text(as_json)
  base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
  root = base / f"orbax-mtc-ondemand-bench-{os.getpid()}"
  runs: list[dict] = []
  try:
    for mib in args.mib:
      for rep in range(args.reps):
        run = run_once(args.procs, mib, root)
        runs.append(run)
        print(f"{mib} MiB rep {rep}: SIGTERM -> durable {run['sigterm_to_durable_s']:.2f}s "
              f"(step {run['step']}; local {run['local_s']:.2f}s, peers {run['peers_s']:.2f}s, "
              f"persistent {run['persistent_s']:.2f}s)", file=text, flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  summary = summarize(runs, args.mib)
  table = markdown(summary, args.procs, args.reps)
  doc = document(args.procs, args.reps, runs, summary)
  if args.out is not None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ondemand.json").write_text(json.dumps(doc, indent=1))
    (out / "ondemand.md").write_text(table + "\n")
  if isinstance(args.json, str):  # the older `--json FILE`
    Path(args.json).write_text(json.dumps(doc, indent=1))
  output.emit(as_json, doc, "\n" + table)
  return 0


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, nargs="+", default=[64, 512],
                      help="state MiB per process, one series each (default: 64 512)")
  parser.add_argument("--procs", type=int, default=2,
                      help="processes of the job (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=3,
                      help="SIGTERM jobs per size; the table gives medians "
                      "(default: %(default)s)")
  # `--json FILE` wrote a file before `--json` meant stdout for every verb: still accepted
  # (with a warning), so that scripts written for it keep their file.
  output.add_json_flag(parser, SCHEMA, nargs="?", const=True, default=False, metavar="FILE",
                       also="; the older --json FILE writes it to FILE instead (deprecated: "
                       "use --out DIR)")
  parser.add_argument("--out", default=None, metavar="DIR",
                      help="also write ondemand.json (the --json document) and ondemand.md "
                      "here (default: none)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--persistent", default=None, help=argparse.SUPPRESS)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.worker:
    return _worker(args)
  if isinstance(args.json, str):
    console.warning(_PROG, f"--json {args.json}: --json takes no file now (it prints the "
                    "document on stdout); writing the file as before, but use --out DIR "
                    "(ondemand.json there) instead")
  return _driver(args)


if __name__ == "__main__":
  sys.exit(main())
