"""One process of `orbax-mtc bench every-step`: a training loop with and without RAM saves.

Run under the launcher (one device per process). For each state size (`--mib`, MiB held by
each process, float32, sharded over the processes on a ("data", "model") mesh of one replica,
so that with 2 or more processes each node's step goes to the next node), each repetition runs
every variant right after a baseline run of the same loop without a manager:

- `every N`: `LocalCheckpointOptions(save_interval_steps=N)` for each N of `--every`;
- `continuous`: `LocalCheckpointOptions(save_decision_policy=ContinuousCheckpointingPolicy())`
  (a RAM save whenever the previous one is done);
- `continuous, budget B %` (with `--budget`): the same with
  `LocalCheckpointOptions.save_overhead_budget` (a save also in progress until the time
  `save()` took since it began is within B % of the time since).

The persistent tier is never due by schedule. One step is `--idle-ms` of idle host time plus a
jitted update of the whole state, the state donated so that its buffers are reused; with
`--sync on` the update also all-reduces a scalar across the processes and waits for it (as a
data-parallel step's gradient all-reduce makes the processes meet every step). Every
process reports its own figures; process 0 prints one `@@every-step <json>` line per size
with, per run, the slowest process's figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Per-process scalars gathered after each run (the slowest process's are kept: max).
_FIELDS = ("loop_s", "save_p50_s", "save_p99_s", "save_max_s", "in_save_s", "saving_p50_s",
           "interval_steps", "interval_s", "protected_s", "protected_steps", "saves",
           "protected_count", "backups", "update_p50_s", "update_sum_s", "sleep_sum_s",
           "behind_chunks", "behind_chunks_extra_s")


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mib", type=int, nargs="+", required=True)
  parser.add_argument("--every", type=int, nargs="*", default=[1, 5, 20])
  parser.add_argument("--continuous", choices=("on", "off"), default="on")
  parser.add_argument("--budget", type=float, default=None)
  parser.add_argument("--chunk-mib", type=int, default=None)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--idle-ms", type=float, default=200.0)
  parser.add_argument("--warm-saves", type=int, default=3)
  parser.add_argument("--donate", choices=("on", "off"), default="on")
  parser.add_argument("--idle", choices=("after-save", "before-save"), default="after-save")
  parser.add_argument("--sync", choices=("on", "off"), default="off")
  parser.add_argument("--background-nice", type=int, default=10)
  parser.add_argument("--persistent", required=True)
  return parser.parse_args(argv)


def _percentile(values: list[float], q: float) -> float:
  """The q-th percentile (nearest rank) of `values`; NaN when empty."""
  if not values:
    return float("nan")
  ordered = sorted(values)
  rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
  return ordered[rank]


def _median(values: list[float]) -> float:
  return statistics.median(values) if values else float("nan")


class Loop:
  """This process's state, update and loop; every run is called by every process alike."""

  def __init__(self, args: argparse.Namespace):
    import jax
    import numpy as np

    from orbax_mtc import distributed

    self.args = args
    self.me, self.n = jax.process_index(), jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    self.mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1), ("data", "model"))
    self.local_root = Path(distributed.local_directory())
    self._barriers = 0
    # The update touches every byte of the state, as an optimizer step does. The state is
    # donated: XLA writes the new values into the old buffers, so a save that still reads
    # them (the writer thread, a peer copy) is where the reuse shows.
    self.update = jax.jit(lambda s: {"w": s["w"] * 0.5 + 1.0},
                          donate_argnums=0 if args.donate == "on" else ())
    if args.sync == "on":
      # A data-parallel step ends with an all-reduce (its gradients, its loss) that every
      # process waits for: a scalar from the new state, replicated, stands for it. Its own
      # function: XLA's CPU client runs an update fused with a cross-process collective
      # about 9x slower (143 ms against 16 for 256 MiB here).
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      loss = jax.jit(lambda w: w[:8, 0].sum(), out_shardings=replicated)
      update = self.update

      def synced(s):
        s = update(s)
        jax.block_until_ready(loss(s["w"]))
        return s
      self.update = synced

  def barrier(self) -> None:
    from jax.experimental import multihost_utils

    self._barriers += 1
    multihost_utils.sync_global_devices(f"every-step-{self._barriers}")

  def slowest(self, values: list[float]) -> list[float]:
    """Each value's maximum over the processes (NaN where any process has none)."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.asarray(values, dtype=np.float64)
    if self.n == 1:
      return [float(v) for v in mine]
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(self.n, -1)
    return [float(v) for v in every.max(axis=0)]

  def idle(self) -> float:
    """Idle host time: stands for the accelerator computing the step, while the host is free
    (a save's background work runs here). Not a synchronisation. Returns the time slept: its
    overrun (the sleeper woken late: a busy host, the GIL) is measured."""
    began = time.perf_counter()
    time.sleep(self.args.idle_ms / 1000)
    return time.perf_counter() - began

  def make_state(self, mib: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cols = 1024
    rows = max(1, mib * 2**20 // 4 // cols) * self.n
    sharding = NamedSharding(self.mesh, P("model"))
    w = jax.jit(lambda: jnp.ones((rows, cols), jnp.float32), out_shardings=sharding)()
    return {"w": jax.block_until_ready(w)}

  def manager(self, folder: Path, abstract: Any, every: int | None,
              budget: float | None = None):
    import orbax.checkpoint as ocp

    import orbax_mtc as mtc

    if every is None:
      local = mtc.LocalCheckpointOptions(
          save_decision_policy=ocp.checkpoint_managers.ContinuousCheckpointingPolicy(),
          max_to_keep=1, save_overhead_budget=budget,
          background_nice=self.args.background_nice)
    else:
      local = mtc.LocalCheckpointOptions(save_interval_steps=every, max_to_keep=1,
                                         background_nice=self.args.background_nice)
    options = mtc.CheckpointManagerOptions(
        local=local,
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9),
        replication=mtc.ReplicationOptions(
            replica_axis="data", peers_per_node=None if self.n > 1 else 0,
            **({} if self.args.chunk_mib is None else {"chunk_mib": self.args.chunk_mib})))
    return mtc.CheckpointManager(folder, Path(self.args.persistent) / folder.name, self.mesh,
                                 abstract, options=options)

  def run(self, state: dict, abstract: Any, every: int | None, *, manager: bool,
          budget: float | None = None) -> tuple[dict, dict[str, float]]:
    """One loop of `--steps` timed steps; `manager` False: the baseline (no manager).

    Returns the state after it and this process's figures (`_FIELDS`)."""
    import jax
    import orbax.checkpoint as ocp

    args = self.args
    folder = self.local_root / "every-step"
    mgr = self.manager(folder, abstract, every, budget) if manager else None

    def save(step: int, current: dict) -> bool:
      return mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(current)))

    step = 0
    if mgr is not None:
      # Steady state: the first saves create the tier's step files (a long run pays that
      # once). Steps due by the schedule, each write finished before the next step.
      made = 0
      while made < args.warm_saves:
        step += 1
        state = jax.block_until_ready(self.update(state))
        if save(step, state):
          made += 1
          mgr.wait_until_finished()
      mgr.wait_until_finished()
      if every is not None:  # the timed loop starts right after a due step
        while step % every:
          step += 1
          state = jax.block_until_ready(self.update(state))
    # "On a peer": the manager's replicator counts the steps whose copies all went out. It is
    # private (no public API says when a step is protected), so read defensively: None, and
    # no figure, where it is missing. Read after each save() call, so to the step.
    replicator = getattr(getattr(getattr(mgr, "_form", None), "peers", None), "replicator",
                         None)
    finished_at_start = replicator.finished_steps if replicator is not None else 0
    # Orbax's default persistent policy also backs up the first step saved (a warm-up one,
    # finished above); none is due in the timed loop.
    backups_at_start = len(list(mgr.backup_history)) if mgr is not None else 0
    calls: list[float] = []
    updates: list[float] = []
    behind: list[bool] = []  # per step: chunks still moving when its update was dispatched
    slept = 0.0
    saving_calls: list[float] = []
    saved: list[tuple[int, float]] = []  # (step, when save() returned)
    protected: list[tuple[int, float]] = []  # (steps, seconds) from save to copies out
    self.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
      step += 1
      # Whether this process's peer-copy chunks still move as the update is dispatched: on
      # the CPU client it then runs only after them (benchmarks/collective_order.py).
      behind.append(bool(getattr(replicator, "chunks_moving", 0)))
      began = time.perf_counter()
      # Waits for the buffers too: on CPU a donated buffer that a save still reads is not
      # reused (XLA gives the update a fresh one), which shows here.
      state = jax.block_until_ready(self.update(state))
      updates.append(time.perf_counter() - began)
      if args.idle == "before-save":
        slept += self.idle()
      if mgr is not None:
        began = time.perf_counter()
        did = save(step, state)
        now = time.perf_counter()
        calls.append(now - began)
        if did:
          saving_calls.append(now - began)
          saved.append((step, now))
        if replicator is not None:
          out = replicator.finished_steps - finished_at_start
          while len(protected) < min(out, len(saved)):
            saved_step, saved_at = saved[len(protected)]
            protected.append((step - saved_step, now - saved_at))
      if args.idle == "after-save":
        slept += self.idle()
    loop_s = time.perf_counter() - start
    backups = 0
    if mgr is not None:
      # The last saves' background work would overlap the steps after them in a long run; a
      # write slower than the interval shows in the next save() call, which is timed.
      mgr.wait_until_finished()
      backups = len(list(mgr.backup_history)) - backups_at_start
      mgr.close()
    self.barrier()
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(Path(args.persistent) / folder.name, ignore_errors=True)
    steps_between = [b[0] - a[0] for a, b in zip(saved, saved[1:], strict=False)]
    seconds_between = [b[1] - a[1] for a, b in zip(saved, saved[1:], strict=False)]
    nan = float("nan")
    figures = {
        "loop_s": loop_s,
        "save_p50_s": _percentile(calls, 50) if calls else nan,
        "save_p99_s": _percentile(calls, 99) if calls else nan,
        "save_max_s": max(calls) if calls else nan,
        "in_save_s": sum(calls) if calls else nan,
        "saving_p50_s": _percentile(saving_calls, 50),
        "interval_steps": _median(steps_between),
        "interval_s": _median(seconds_between),
        "protected_s": _median([p[1] for p in protected]) if replicator is not None else nan,
        "protected_steps": _median([p[0] for p in protected]) if replicator is not None else nan,
        "saves": float(len(saved)) if mgr is not None else nan,
        "protected_count": float(len(protected)) if replicator is not None else nan,
        "backups": float(backups) if mgr is not None else nan,
        "update_p50_s": _percentile(updates, 50),
        "update_sum_s": sum(updates),
        "behind_chunks": float(sum(behind)) if replicator is not None else nan,
        # What those updates took beyond the others' median.
        "behind_chunks_extra_s": _behind_extra(updates, behind) if replicator is not None
                                 else nan,
        "sleep_sum_s": slept,
    }
    return state, figures


def _behind_extra(updates: list[float], behind: list[bool]) -> float:
  """The time the updates dispatched behind moving chunks took beyond the median of the
  others (0 when none was)."""
  clear = [u for u, b in zip(updates, behind, strict=True) if not b]
  if not clear or len(clear) == len(updates):
    return 0.0
  typical = _percentile(clear, 50)
  return sum(u - typical for u, b in zip(updates, behind, strict=True) if b)


def _clean(value: float) -> float | None:
  return None if value != value else value


def main(argv: list[str] | None = None) -> int:
  import jax

  from orbax_mtc import arrays, distributed

  args = _parse(argv)
  distributed.initialize()
  loop = Loop(args)
  variants: list[tuple[str, int | None, float | None]] = [
      (f"every {n}", n, None) for n in args.every]
  if args.continuous == "on":
    variants.append(("continuous", None, None))
    if args.budget is not None:
      variants.append((f"continuous, budget {100 * args.budget:g} %", None, args.budget))
  for mib in args.mib:
    state = loop.make_state(mib)
    abstract = arrays.abstract_tree(state)
    nbytes = sum(s.data.nbytes for s in state["w"].addressable_shards)
    state, _ = loop.run(state, abstract, None, manager=False)  # compiles the update
    runs = []
    for rep in range(args.reps):
      for name, every, budget in variants:
        record: dict[str, Any] = {"rep": rep, "name": name, "every": every, "budget": budget}
        for key, with_manager in (("baseline", False), ("variant", True)):
          state, figures = loop.run(state, abstract, every, manager=with_manager,
                                    budget=budget)
          slowest = loop.slowest([figures[f] for f in _FIELDS])
          record[key] = {f: _clean(v) for f, v in zip(_FIELDS, slowest, strict=True)}
        runs.append(record)
        if loop.me == 0:
          base, var = record["baseline"]["loop_s"], record["variant"]["loop_s"]
          saves = record["variant"]["saves"] or 0
          print(f"@@progress {mib} MiB rep {rep} {name}: loop {var:.2f} s against "
                f"{base:.2f} s ({100 * (var - base) / base:+.1f} %), {saves:.0f} saves",
                flush=True)
    del state
    if loop.me == 0:
      print("@@every-step " + json.dumps({
          "procs": loop.n, "mib": mib, "bytes_per_process": nbytes,
          "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
          "peers": loop.n > 1, "steps": args.steps, "idle_ms": args.idle_ms,
          "donate": args.donate == "on", "idle": args.idle, "sync": args.sync == "on",
          "runs": runs}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
