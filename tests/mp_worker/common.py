"""What every sub-command shares: the job's mesh and state, the manager, restore-and-check, the
save loop, and the exit codes (listed in `__main__`).

States come from `orbax_mtc.testing`: a pure function of (seed, step, mesh shape), so a process
that restores step S recomputes what was saved at S and compares it bit for bit, on its own
shards only. JAX is imported inside the functions.
"""

from __future__ import annotations

import pathlib
from typing import Any

from orbax_mtc import testing

from . import hooks
from .events import emit

EXIT_MISMATCH = 3  # wrong data, or a wrong step or tier
EXIT_USAGE = 4
EXIT_NO_PREEMPTION = 5  # preempt: no preemption within --max-steps
EXIT_BAD_ONDEMAND = 6  # preempt: the on-demand save did not behave as asked
EXIT_RAISED = 7  # fault, open: the manager raised (reported as RAISED)

# Set from the command line: data-axis size (None: one row per process), how leaves use the
# "data" axis ("mixed"; "dp": replicated across it, pure data parallelism) and key leaves.
CONFIG: dict[str, Any] = {"replicas": None, "layout": "mixed", "keys": False,
                          "shape_axes": None}

LEAVES = len(testing.ARRAY_LEAVES)  # the leaves= field of RESULT lines


def configure(args) -> None:
  axes = getattr(args, "shape_axes", None)
  CONFIG.update(keys=getattr(args, "keys", False), replicas=getattr(args, "replicas", None),
                layout=getattr(args, "layout", "mixed"),
                shape_axes=tuple(int(x) for x in axes.split(",")) if axes else None)


def make_mesh():
  """(data, model): data = --replicas (default: process_count), model = the rest."""
  return testing.process_mesh(CONFIG["replicas"])


def abstract_state(mesh, rows: int) -> dict:
  return testing.abstract_sharded_state(mesh, rows, layout=CONFIG["layout"],
                                        keys=CONFIG["keys"], shape_axes=CONFIG["shape_axes"])


def make_state(mesh, rows: int, seed: int, step: int) -> dict:
  return testing.sharded_state(mesh, rows, seed, step, layout=CONFIG["layout"],
                               keys=CONFIG["keys"], shape_axes=CONFIG["shape_axes"])


def compare_state(restored: Any, expected: Any) -> list[str]:
  """Problems found comparing this process's shards of `restored` with `expected` (bit-exact)."""
  return testing.tree_differences(restored, expected)


def manager(args, mesh, *, exit_after_ondemand_checkpoint: bool | None = None,
            ondemand_grace_seconds: float | None = None):
  """The manager every sub-command uses; the on-demand options are passed only when given."""
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  if args.set_mesh:  # explicit-sharding code sets its mesh for everything that follows
    import jax

    jax.set_mesh(mesh)
  local_dir = args.local_dir or distributed.local_directory()
  if not local_dir:
    raise SystemExit("no --local-dir and no ORBAX_MTC_LOCAL_DIR")
  if getattr(args, "stretch", None):
    hooks.fixed_stretch(args.stretch)
  if getattr(args, "call_mib", None):
    hooks.small_replication_calls(args.call_mib << 20)
  extra: dict[str, Any] = {}
  if exit_after_ondemand_checkpoint is not None:
    extra["exit_after_ondemand_checkpoint"] = exit_after_ondemand_checkpoint
  if ondemand_grace_seconds is not None:
    extra["ondemand_grace_seconds"] = ondemand_grace_seconds
  if getattr(args, "backup_timeout", None):
    extra["async_options"] = ocp.AsyncOptions(timeout_secs=args.backup_timeout)
  if getattr(args, "agreement_timeout", None):
    extra["agreement_timeout_seconds"] = args.agreement_timeout
  if getattr(args, "mode", "standalone") == "managed":
    extra["mode"] = "managed"
    extra["managed"] = mtc.ManagedOptions(peers_per_node=args.managed_peers_per_node,
                                          timeout_seconds=args.managed_timeout,
                                          poll_seconds=0.02)
    extra["job_name"] = args.job_name
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=args.local_interval,
                                       max_to_keep=args.local_keep),
      persistent=mtc.PersistentCheckpointOptions(
          max_to_keep=args.persistent_keep,
          **({"backup_interval_minutes": args.backup_minutes}
             if getattr(args, "backup_minutes", None) else
             {"save_interval_steps": args.persistent_interval})),
      replication=mtc.ReplicationOptions(
          replica_axis="data", peers_per_node=args.peers_per_node,
          max_spread_intervals=getattr(args, "stretch", None) or getattr(args, "max_spread", 1),
          **({"chunk_mib": args.chunk_mib} if getattr(args, "chunk_mib", None) else {})),
      **extra)
  return mtc.CheckpointManager(
      local_dir, args.persistent_dir, mesh, abstract_state(mesh, args.rows), options=options,
      persistent_non_replicated_directory=getattr(args, "dataset_dir", None))


def fmt(steps) -> str:
  return ",".join(str(s) for s in sorted(steps)) or "-"


def restore_and_check(args, mgr, mesh) -> tuple[int | None, bool]:
  """Restores, compares, prints RESULT; returns (step, ok) where ok includes expectations."""
  import jax
  import orbax.checkpoint as ocp

  cast = getattr(args, "cast_to", None)
  # --resume-latest: Orbax's and MaxText's resume idiom, `restore(latest_step())`. Either
  # way RESULT says what latest_step() named before and after, which the campaigns check.
  listed = mgr.latest_step()
  wanted = listed if getattr(args, "resume_latest", False) else None
  if args.explicit_args or cast:
    restored = mgr.restore(wanted, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=_cast(abstract_state(mesh, args.rows), cast))))
  else:
    restored = mgr.restore(wanted)
  info = mgr.last_restore
  after = mgr.latest_step()  # a restore drops the newer leftovers: the step restored
  step, tier = (info.step, info.tier) if info is not None else (None, "?")
  problems: list[str] = []
  if restored is None:
    if step is not None:
      problems.append(f"restore returned None but last_restore says step {step}")
  else:
    state = restored.state if isinstance(restored, ocp.args.Composite) else restored
    problems += compare_state(state, _cast(make_state(mesh, args.rows, args.seed, step), cast))
  ok = not problems
  expect_ok = True
  if args.expect_step is not None and str(step) != args.expect_step:
    expect_ok = False
  if args.expect_tier is not None and tier != args.expect_tier:
    expect_ok = False
  detail = "; ".join(problems)[:2000].replace("\n", " ") or "-"
  seconds = f"{info.seconds:.6f}" if info is not None else "-"
  emit(f"RESULT process={jax.process_index()} step={step} tier={tier} ok={int(ok)} "
       f"leaves={LEAVES} seconds={seconds} listed={listed} after={after} detail={detail}")
  return step, ok and expect_ok


def _cast(tree: Any, dtype: str | None) -> Any:
  """`tree` with its float32 leaves (arrays or abstract ones) as `dtype`; as it is for None."""
  import jax
  import numpy as np

  if dtype is None:
    return tree

  def cast(leaf):
    if leaf.dtype != np.float32:
      return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return leaf.astype(dtype)  # finite values: XLA rounds as TensorStore does
  return jax.tree.map(cast, tree)


def committed(args, mgr) -> None:
  """Prints this process's committed local steps and the persistent steps (from the folders)."""
  import jax
  from etils import epath

  from orbax_mtc.local import store as local_store

  folder = epath.Path(args.persistent_dir)
  # Complete steps only: a gs:// step folder counts once Orbax wrote its commit marker.
  persistent = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (
      not args.persistent_dir.startswith("gs://") or (p / "commit_success.txt").exists())
                      ) if folder.is_dir() else []
  emit(f"COMMITTED process={jax.process_index()} "
       f"local={fmt(local_store.committed_steps(pathlib.Path(mgr.local_directory)))} "
       f"persistent={fmt(persistent)}")


def raised(error: BaseException) -> None:
  import jax

  text = f"{error}".replace("\n", " ")[:1500]
  emit(f"RAISED process={jax.process_index()} type={type(error).__name__} detail={text}")


_REDUCE: Any = None
_TRAIN_STEPS = [0]  # train_step calls so far (PROGRESS lines)


def report_progress_at(*seconds: float) -> None:
  """Prints PROGRESS (train steps so far) at each of these times after start, from a daemon
  thread: two lines that differ show a loop still running; equal ones, a process that waits
  (no line at all: a thread holds the GIL while it waits in C)."""
  import threading
  import time

  start = time.monotonic()

  def report() -> None:
    for at in sorted(seconds):
      time.sleep(max(0.0, at - (time.monotonic() - start)))
      emit(f"PROGRESS train_steps={_TRAIN_STEPS[0]} at={at:g}")

  threading.Thread(target=report, name="progress", daemon=True).start()


def train_step(state: dict) -> float:
  """A global reduction over every shard: like a training step, an all-reduce across all
  processes, so no process runs more than a step ahead of the others."""
  global _REDUCE
  import jax
  import jax.numpy as jnp

  if _REDUCE is None:
    _REDUCE = jax.jit(lambda tree: sum(jnp.sum(x.astype(jnp.float32))
                                       for x in jax.tree.leaves(tree)
                                       if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))
  _TRAIN_STEPS[0] += 1
  return float(_REDUCE(state))


def save_loop(args, mgr, mesh, start: int, stop: int) -> None:
  """Saves steps [start, stop) (SAVING/SAVED lines), then waits and prints COMMITTED.

  At --die-at-step every process calls save(step) but --die-process never completes its local
  write and is SIGKILLed (`hooks.diverge_and_die`), which does not return.
  """
  import jax
  import orbax.checkpoint as ocp

  me = jax.process_index()
  for step in range(start, stop):
    state = make_state(mesh, args.rows, args.seed, step)
    if not getattr(args, "no_step_collective", False):
      train_step(state)
    if args.die_at_step == step:
      hooks.diverge_and_die(mgr, me, step, state, dying=me == args.die_process,
                            report=lambda: committed(args, mgr))
    emit(f"SAVING step={step}")
    saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    if saved and args.land_backups and step % args.persistent_interval == 0:
      # This loop has no compute between saves, so a backup would still be uploading when
      # the next is due and be replaced by it; wait, so every scheduled backup lands.
      mgr.wait_until_finished()
    emit(f"SAVED step={step} saved={int(saved)}")
    if getattr(args, "report_copies", False):
      copies = ",".join(f"{a}:{b}" for a, b in hooks.peer_copies(mgr)) or "-"
      emit(f"HELD step={step} copies={copies}")
  mgr.wait_until_finished()
  committed(args, mgr)
