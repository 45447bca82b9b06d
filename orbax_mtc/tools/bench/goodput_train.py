"""The training job of `orbax-mtc bench goodput` (one copy per process, under the launcher).

A state of `--mib` MiB per process, sharded over a (data, model) mesh of one device per
process, trained by a fixed amount of real compute per step (`--work` chained matmuls) and an
all-reduce across processes. `--system mtc` checkpoints with orbax_mtc (RAM every
`--local-every` steps, peers, persistent every `--persistent-every`); `--system orbax` with a
plain `ocp.CheckpointManager` to the persistent folder only, every `--persistent-every` steps.
Both save an on-demand checkpoint on SIGTERM (JAX's sync point) and then stop with status 0.

Process 0 appends one JSON line per event to `--report` (flushed, so a SIGKILL loses at most
the line being written) and prints `@@gp STEP <n>` after each step for the driver.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_CTRL = "@@gp"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--system", choices=("mtc", "orbax"), required=True)
  p.add_argument("--persistent-dir", required=True)
  p.add_argument("--report", required=True)
  p.add_argument("--run", type=int, default=1)
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--work", type=int, default=8, help="256x256 matmuls per step")
  p.add_argument("--mib", type=int, default=32, help="state MiB per process")
  p.add_argument("--min-step-ms", type=float, default=0.0,
                 help="pad each step to this long (stands for accelerator time)")
  p.add_argument("--local-every", type=int, default=10)
  p.add_argument("--persistent-every", type=int, default=100)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  import orbax_mtc as mtc

  info = mtc.distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  n, me = jax.process_count(), jax.process_index()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(n, -1), ("data", "model"))
  cols = 1024
  rows = max(1, args.mib * 2**20 // 4 // cols) * n
  w_sharding = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())
  abstract = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=w_sharding),
              "step": np.asarray(0, np.int32)}

  def init():
    return jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols) * 1e-9

  x0 = jax.jit(lambda: jnp.eye(256, dtype=jnp.float32) * 0.5 + 0.01,
               out_shardings=replicated)()

  def step_fn(w, x):
    x = jax.lax.fori_loop(0, args.work, lambda i, x: jnp.tanh(x @ x + 0.01), x)
    w = w * 0.9999 + jnp.mean(x) * 1e-6
    return w, jnp.sum(w)  # the sum is an all-reduce across processes

  train = jax.jit(step_fn, out_shardings=(w_sharding, replicated))
  report = open(args.report, "a") if me == 0 else None  # noqa: SIM115 - kept open all run

  def log(event: str, **fields) -> None:
    if report is not None:
      report.write(json.dumps({"event": event, "run": args.run, "t": time.time(), **fields})
                   + "\n")
      report.flush()

  if args.system == "mtc":
    options = mtc.CheckpointManagerOptions(
        local=mtc.LocalCheckpointOptions(save_interval_steps=args.local_every, max_to_keep=2),
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=args.persistent_every,
                                                   max_to_keep=2),
        replication=mtc.ReplicationOptions(replica_axis="data"), job_name="goodput")
    mgr = mtc.CheckpointManager(info.local_directory, args.persistent_dir, mesh, abstract,
                                options=options)
  else:
    mgr = ocp.CheckpointManager(args.persistent_dir, options=ocp.CheckpointManagerOptions(
        save_interval_steps=args.persistent_every, max_to_keep=2))

  started = time.perf_counter()
  if args.system == "mtc":
    restored = mgr.restore(None)
    state = restored.state if restored is not None else None
    tier = mgr.last_restore.tier
  else:
    latest = mgr.latest_step()
    state, tier = None, "none"
    if latest is not None:
      restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
      state = mgr.restore(latest, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract, restore_args=restore_args))).state
      tier = "persistent"
  if state is None:
    state = {"w": jax.jit(init, out_shardings=w_sharding)(), "step": np.asarray(0, np.int32)}
  jax.block_until_ready(state["w"])
  first = int(state["step"])
  log("start", restored=first, tier=tier, restore_s=time.perf_counter() - started)

  for step in range(first + 1, args.steps + 1):
    t0 = time.perf_counter()
    w, total = train(state["w"], x0)
    float(total)  # the step is done on every process
    pad = args.min_step_ms / 1e3 - (time.perf_counter() - t0)
    if pad > 0:
      time.sleep(pad)  # simulated device time, not synchronisation
    t1 = time.perf_counter()
    state = {"w": w, "step": np.asarray(step, np.int32)}
    saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    t2 = time.perf_counter()
    preempted = mgr.should_exit() if args.system == "mtc" else mgr.reached_preemption(step)
    log("step", step=step, compute_s=t1 - t0, save_s=t2 - t1, saved=bool(saved),
        preempted=bool(preempted))
    print(f"{_CTRL} STEP {step}", flush=True)
    if preempted:
      t3 = time.perf_counter()
      mgr.wait_until_finished()
      log("preempted", step=step, wait_s=time.perf_counter() - t3)
      mgr.close()
      return 0
  t3 = time.perf_counter()
  mgr.wait_until_finished()
  log("done", step=args.steps, wait_s=time.perf_counter() - t3)
  mgr.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
