"""`save()` blocking per step while peer copies go out, against the local save interval.

A training loop whose step is `--step-ms` of idle host time (as while an accelerator
computes) calls `save()` every step; the RAM tier saves every `--interval` steps and each
saved step's copies go to the next process (one replica, a ring). Run it under the launcher
(one CPU device per process):

  orbax-mtc launch --nprocs 2 --devices-per-process 1 --local-root /dev/shm/ri -- \
      python benchmarks/replication_interval.py --mib 512 --intervals 1 5 20

Prints, per interval, the slowest process's `save()` blocking time per step (p50, p99, max;
and apart for the saving calls and the calls between them),
how many local saves found the previous step's copies still pending (flushed, blocking, by
that save, or carried on when the link lags them: peers/spread.py), how many saved steps got
copies of their own, how long after its save a step was protected on its peer (its copies
committed, median), the spread after each local save (in intervals), and, in the same run,
the raw ring `ppermute` bandwidth of the same bytes and a step's own work on this host: each
process writes the bytes to its RAM disk while the ring moves them, then writes the copy it
received (longer than an interval: no spread keeps the copies within one; `--sync-step`: each
step also meets the other processes, as a data-parallel step). The first
`--warm-saves` local intervals are not timed: their saves create the RAM tier's files and the
peer copies' (a long run pays that once). The default 4 is what the RAM tier's 2 steps need:
the first 3 saves and their copies write new files (the 4th reuses the 1st's), and the 3rd's
copies still move during the 4th's interval. On a host whose never-touched memory is slow
(this VM: a 1 GiB write into new pages took 3 s, 0.25 s into reused ones) fewer mix that
one-time cost into the steady state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import orbax_mtc as mtc
from orbax_mtc import distributed
from orbax_mtc.tools.bench import limits


def _slowest(values: np.ndarray) -> np.ndarray:
  return multihost_utils.process_allgather(np.asarray(values, np.float64)).max(axis=0)


def _meet(state: jax.Array, mesh: jax.sharding.Mesh):
  """A data-parallel step's all-reduce (its gradients, its loss), waited for: the processes
  meet every step. A scalar from the state, replicated, stands for it."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  loss = jax.jit(lambda w: w[:8, 0].sum(), out_shardings=replicated)
  return lambda: jax.block_until_ready(loss(state))


def run_interval(interval: int, state: jax.Array, mesh: jax.sharding.Mesh, root: Path,
                 persistent: Path, step_ms: float, intervals: int, warm: int = 0,
                 sync_step: bool = False, keep: int = 2, max_spread: int | None = None) -> dict:
  replication = mtc.ReplicationOptions() if max_spread is None else \
      mtc.ReplicationOptions(max_spread_intervals=max_spread)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=interval, max_to_keep=keep),
      replication=replication,
      persistent=mtc.PersistentCheckpointOptions(should_save_fn=lambda step, last: False))
  local = root / f"interval-{interval}"
  abstract = {"w": jax.ShapeDtypeStruct(state.shape, state.dtype, sharding=state.sharding)}
  blocking, pending = [], 0
  first = interval * warm + 1  # the first timed call (step 0 sets up the first transfer)
  saved: dict[int, float] = {}  # when each local save returned
  protected: dict[int, float] = {}  # step -> seconds from its save to its copies landing
  stretches: list[int] = []  # the spread (in intervals) after each timed local save
  with mtc.CheckpointManager(local, persistent / f"interval-{interval}", mesh, abstract,
                             options=options) as mgr:
    # Private: no public API says when a step is protected (as `bench every-step`).
    replicator = mgr._form.peers.replicator  # noqa: SLF001 - the measure
    meet = _meet(state, mesh) if sync_step else None
    for step in range(interval * (warm + intervals) + 1):
      time.sleep(step_ms / 1000)  # the accelerator's step: idle host time
      if meet is not None:
        meet()
      if step % interval == 0 and step >= first:
        # The previous step's copies not yet issued or still moving: this save waits for
        # them, or carries them on (its own step then sends none).
        pending += mgr._form.peers.busy  # noqa: SLF001 - the measure
      started = time.perf_counter()
      mgr.save(step, args=ocp.args.Composite(w=ocp.args.PyTreeSave(state)))
      now = time.perf_counter()
      blocking.append(now - started)
      if step % interval == 0:
        saved[step] = now
        if step >= first:
          stretches.append(mgr._form.peers.stretch.intervals)  # noqa: SLF001 - the measure
      landed = replicator.landed_step  # agreed: the same on every process
      if landed is not None and landed not in protected and landed in saved:
        protected[landed] = now - saved[landed]
    mgr.wait_until_finished()
  shutil.rmtree(local, ignore_errors=True)
  per_step = _slowest(np.asarray(blocking))[first:]
  # The saving calls and the calls between them apart: a periodic flush shows as saving calls
  # far slower than their own median; the calls between saves carry the copies.
  saving = np.arange(first, first + len(per_step)) % interval == 0
  timed_steps = sorted(s for s in protected if first <= s < interval * (warm + intervals) + 1)
  timed = _slowest(np.asarray([protected[s] for s in timed_steps], np.float64))
  return {"interval": interval, "steps": len(per_step), "p50_s": float(np.median(per_step)),
          "p99_s": float(np.quantile(per_step, 0.99)), "max_s": float(per_step.max()),
          **_quantiles("saving", per_step[saving]), **_quantiles("between", per_step[~saving]),
          "local_saves": intervals, "warm_saves": warm, "pending_at_local_save": int(pending),
          # Timed local saves whose own step's copies landed (the others' saves carried an
          # earlier step's copies on, the link lagging them: peers/spread.py).
          "copied_saves": len(timed_steps),
          "protected_p50_s": float(np.median(timed)) if timed.size else None,
          # Each timed call's blocking (the slowest process), ms; the local saves are the
          # calls at multiples of the interval (index 0 is the call after step `first` - 1).
          "per_call_ms": [round(float(v) * 1000, 2) for v in per_step],
          "spread_intervals": stretches,
          "first_step": first}


def _quantiles(name: str, seconds: np.ndarray) -> dict[str, float | None]:
  if not seconds.size:
    return {f"{name}_p50_s": None, f"{name}_p99_s": None}
  return {f"{name}_p50_s": float(np.median(seconds)),
          f"{name}_p99_s": float(np.quantile(seconds, 0.99))}


def _slowest_median(name: str, run) -> float:
  """Seconds `run()` took on the slowest process, the median of three (all start together)."""
  seconds = []
  for _ in range(3):
    multihost_utils.sync_global_devices(name)
    started = time.perf_counter()
    run()
    seconds.append(float(_slowest(np.asarray([time.perf_counter() - started]))[0]))
  return float(np.median(seconds))


def _ring_gbps(ring: limits.RingPermute, nbytes: int) -> float:
  """The ring `ppermute`'s bandwidth."""
  return nbytes / _slowest_median("ring", ring) / 1e9


def _step_work_seconds(ring: limits.RingPermute, data: np.ndarray, paths: list[Path]) -> float:
  """Seconds to write `data` to `paths[0]` while the ring `ppermute` moves as many bytes,
  then write it to `paths[1]` (the copy received)."""

  def step_work() -> None:
    writer = threading.Thread(target=limits.raw_write, args=(str(paths[0]), data),
                              kwargs={"overwrite": True})
    writer.start()
    ring()
    writer.join()
    limits.raw_write(str(paths[1]), data, overwrite=True)
  return _slowest_median("step work", step_work)


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1000:.1f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=512, help="state MiB per process")
  parser.add_argument("--intervals", type=int, nargs="+", default=[1, 5, 20])
  parser.add_argument("--local-saves", type=int, default=3, help="local saves per interval")
  parser.add_argument("--warm-saves", type=int, default=4,
                      help="local intervals run first, not timed (steady state; default 4)")
  parser.add_argument("--step-ms", type=float, default=50.0)
  parser.add_argument("--persistent", default="/tmp/replication-interval")
  parser.add_argument("--json", help="also write the results here (process 0)")
  parser.add_argument("--keep", type=int, default=2,
                      help="RAM steps kept (max_to_keep; 1 halves the RAM disk's share at 1 GiB)")
  parser.add_argument("--sync-step", action="store_true",
                      help="each step ends with a cross-process all-reduce every process waits "
                           "for, as a data-parallel step's (the processes meet every step)")
  parser.add_argument("--max-spread", type=int,
                      help="ReplicationOptions.max_spread_intervals (default: the option's)")
  args = parser.parse_args()
  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index))
                           .reshape(1, n), ("data", "model"))
  rows = (args.mib << 20) // (4 * 1024)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
  state = jax.make_array_from_callback(
      (rows * n, 1024), sharding,
      lambda index: np.random.default_rng(me).random((rows, 1024), dtype=np.float32))
  ring = limits.RingPermute(args.mib << 20)
  root = Path(distributed.local_directory())
  ppermute_gbps = _ring_gbps(ring, args.mib << 20)
  # A step's own work on this host, apart from training: each process writes the step to
  # its RAM disk while the ring moves the same bytes, then writes the copy it received. More
  # than an interval, and no spread keeps the copies within one.
  host_bytes = np.asarray(state.addressable_shards[0].data).view(np.uint8).reshape(-1)
  scratch = [root / "bench-step-write", root / "bench-copy-write"]
  for path in scratch:
    limits.raw_write(str(path), host_bytes, overwrite=False)  # their pages, once
  try:
    step_work_s = _step_work_seconds(ring, host_bytes, scratch)
  finally:
    for path in scratch:
      path.unlink()
  results = [run_interval(i, state, mesh, root, Path(args.persistent), args.step_ms,
                          args.local_saves, args.warm_saves, args.sync_step, args.keep,
                          args.max_spread)
             for i in args.intervals]
  if me == 0:
    meets = ", processes meet every step" if args.sync_step else ""
    print(f"{args.mib} MiB per process, {n} processes, step {args.step_ms:.0f} ms{meets}, ring "
          f"ppermute {ppermute_gbps:.2f} GB/s; a step's write, copy and the copy's write "
          f"{step_work_s:.2f} s (same run)")
    print("| local interval | save() p50 / p99 / max, ms | saving calls p50 / p99 | calls "
          "between saves p50 / p99 | local saves finding copies pending | saves whose copies "
          "landed | protected on the peer after (p50) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
      after = "-" if r["protected_p50_s"] is None else f"{r['protected_p50_s']:.2f} s"
      print(f"| {r['interval']} | {_ms(r['p50_s'])} / {_ms(r['p99_s'])} / {_ms(r['max_s'])} | "
            f"{_ms(r['saving_p50_s'])} / {_ms(r['saving_p99_s'])} | "
            f"{_ms(r['between_p50_s'])} / {_ms(r['between_p99_s'])} | "
            f"{r['pending_at_local_save']} of {r['local_saves']} "
            f"| {r['copied_saves']} of {r['local_saves']} | {after} |")
    if args.json:
      Path(args.json).write_text(json.dumps({"mib": args.mib, "processes": n,
                                             "ppermute_gbps": ppermute_gbps,
                                             "step_work_s": step_work_s,
                                             "sync_step": args.sync_step, "keep": args.keep,
                                             "results": results}, indent=1))


if __name__ == "__main__":
  main()
