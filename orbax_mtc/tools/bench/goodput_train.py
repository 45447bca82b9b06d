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
  p.add_argument("--system", choices=("mtc", "orbax", "emergency"), required=True)
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
  p.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                 help="data-parallel replicas of the state (emergency needs 2)")
  p.add_argument("--save-step-zero", action="store_true",
                 help="on a fresh start, save step 0 first (as MaxText does)")
  p.add_argument("--extra-steps", type=int, default=0,
                 help="stop (as at --steps) this many steps after the restored step; 0: off")
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
  if args.system == "emergency" and (args.replicas != 2 or n % 2):
    raise SystemExit("--system emergency needs --replicas 2 and an even process count")
  cols = 1024
  if args.replicas == 1:
    mesh = Mesh(np.array(devices).reshape(n, -1), ("data", "model"))
    rows = max(1, args.mib * 2**20 // 4 // cols) * n
    w_sharding = NamedSharding(mesh, P("data"))
  else:  # two replicas, each sharded over half the processes
    mesh = Mesh(np.array(devices).reshape(2, -1), ("data", "model"))
    rows = max(1, args.mib * 2**20 // 4 // cols) * (n // 2)
    w_sharding = NamedSharding(mesh, P("model"))
  replicated = NamedSharding(mesh, P())
  abstract = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=w_sharding),
              "step": np.asarray(0, np.int32)}
  if args.system == "emergency":  # every leaf a global array, as its restore expects
    abstract["step"] = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)

  to_global = jax.jit(lambda s: s, out_shardings=replicated)  # no cross-process check

  def step_leaf(step: int):
    if args.system == "emergency":
      return to_global(np.asarray(step, np.int32))
    return np.asarray(step, np.int32)

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
  elif args.system == "emergency":
    mgr = _emergency_manager(args, info.local_directory, mesh, abstract)
  else:
    mgr = ocp.CheckpointManager(args.persistent_dir, options=ocp.CheckpointManagerOptions(
        save_interval_steps=args.persistent_every, max_to_keep=2))

  started = time.perf_counter()
  if args.system == "mtc":
    restored = mgr.restore(None)
    state = restored.state if restored is not None else None
    tier = mgr.last_restore.tier
  elif args.system == "emergency":
    state, tier = None, "none"
    latest = mgr.latest_step()
    if latest is not None:
      # Its restore reads RAM when one replica holds the whole step, else persistent storage.
      inner = mgr._checkpoint_manager  # its multi-replica manager (private)
      tier = "local" if inner._find_slice_with_complete_local_checkpoint(latest) > -1 else (
          "persistent")
      state = mgr.restore(latest).state
  else:
    latest = mgr.latest_step()
    state, tier = None, "none"
    if latest is not None:
      restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
      state = mgr.restore(latest, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract, restore_args=restore_args))).state
      tier = "persistent"
  fresh = state is None
  if fresh:
    state = {"w": jax.jit(init, out_shardings=w_sharding)(), "step": step_leaf(0)}
  jax.block_until_ready(state["w"])
  first = int(state["step"])
  log("start", restored=first, tier=tier, restore_s=time.perf_counter() - started)
  if fresh and args.save_step_zero:
    t0 = time.perf_counter()
    saved = mgr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    log("save0", saved=bool(saved), save_s=time.perf_counter() - t0)
  last = args.steps if args.extra_steps <= 0 else min(args.steps, first + args.extra_steps)

  for step in range(first + 1, last + 1):
    t0 = time.perf_counter()
    w, total = train(state["w"], x0)
    float(total)  # the step is done on every process
    pad = args.min_step_ms / 1e3 - (time.perf_counter() - t0)
    if pad > 0:
      time.sleep(pad)  # simulated device time, not synchronisation
    t1 = time.perf_counter()
    state = {"w": w, "step": step_leaf(step)}
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
  log("done", step=last, wait_s=time.perf_counter() - t3)
  mgr.close()
  return 0


def _emergency_manager(args, local_directory: str, mesh, abstract):
  """Orbax's emergency manager as MaxText builds it (id maps first, local folder made)."""
  from pathlib import Path

  from absl import flags
  from orbax.checkpoint._src.multihost import multihost as ocp_multihost
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

  if not flags.FLAGS.is_parsed():  # its restore reads absl flags; MaxText runs under absl.app
    flags.FLAGS(sys.argv[:1])
  ocp_multihost.initialize_runtime_to_distributed_ids()
  ocp_multihost.initialize_distributed_to_device_ids()
  Path(local_directory).mkdir(parents=True, exist_ok=True)
  options = emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(save_interval_steps=args.local_every,
                                             max_to_keep=2),
      persistent=emergency.PersistentCheckpointOptions(
          save_interval_steps=args.persistent_every, max_to_keep=2))
  return emergency.CheckpointManager(local_directory, args.persistent_dir, mesh, abstract,
                                     options=options)


if __name__ == "__main__":
  sys.exit(main())
