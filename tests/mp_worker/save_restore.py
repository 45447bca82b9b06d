"""Sub-commands that save and restore: save, restore, resave, chaos, steps, open, force-old,
mirror."""

from __future__ import annotations

import os
import pathlib

from . import hooks
from .common import (
    EXIT_MISMATCH,
    EXIT_RAISED,
    LEAVES,
    abstract_state,
    committed,
    compare_state,
    fmt,
    make_mesh,
    make_state,
    manager,
    raised,
    restore_and_check,
    save_loop,
    train_step,
)
from .events import emit


def cmd_save(args) -> int:
  """Saves steps [--start, --steps) (optionally restores first and resumes), then closes."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  if args.count_rounds:
    hooks.count_rounds()
  with manager(args, mesh) as mgr:
    start, ok = args.start, True
    if args.restore_first:
      step, ok = restore_and_check(args, mgr, mesh)
      start = 0 if step is None else step + 1
    save_loop(args, mgr, mesh, start, args.steps)
    if args.restore_after:
      _restore_again(args, mgr, mesh)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def _restore_again(args, mgr, mesh) -> None:
  """restore(None) once the saves are done (AGAIN: the step, the listing after, its check)."""
  import jax
  import orbax.checkpoint as ocp

  mgr.wait_until_finished()
  restored = mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
  step = mgr.last_restore.step
  problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
  emit(f"AGAIN process={jax.process_index()} step={step} all={fmt(mgr.all_steps())} "
       f"ok={int(not problems)}")


def cmd_restore(args) -> int:
  """restore(None) and compare; --expect-step/--expect-tier make a mismatch an error."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  with manager(args, mesh) as mgr:
    _, ok = restore_and_check(args, mgr, mesh)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_resave(args) -> int:
  """Saves steps [0, --steps), then every process saves again, forced: the newest step after
  --drop-process lost it from RAM (only), then the one before (in RAM everywhere)."""
  import jax
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with manager(args, mesh) as mgr:
    save_loop(args, mgr, mesh, 0, args.steps)
    newest = args.steps - 1
    if me == args.drop_process:
      hooks.drop_local_step(mgr, newest)  # this node alone no longer holds it
    multihost_utils.sync_global_devices("mp-worker-resave")
    for step in (newest, newest - 1):
      state = make_state(mesh, args.rows, args.seed, step)
      try:
        saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)),
                         force=True)
        outcome = f"saved={int(saved)}"
      except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}".replace("\n", " ")
      emit(f"RESAVE process={me} step={step} detail={outcome}")
    mgr.wait_until_finished()
    emit(f"PERSISTENT process={me} steps={fmt(hooks.persistent_steps(mgr))}")
  return 0


def cmd_chaos(args) -> int:
  """Restore + check, then save every step until killed (or --steps more steps)."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  with manager(args, mesh) as mgr:
    step, ok = restore_and_check(args, mgr, mesh)
    if not ok:
      return EXIT_MISMATCH
    start = 0 if step is None else step + 1
    save_loop(args, mgr, mesh, start, start + args.steps)
  emit("DONE")
  return 0


def cmd_steps(args) -> int:
  """Prints all_steps()/latest_step(), then restores each of --restore-steps ('latest' is
  `mgr.latest_step()`, Orbax's and MaxText's resume idiom) with explicit args and compares."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with manager(args, mesh) as mgr:
    emit(f"STEPS process={me} all={fmt(mgr.all_steps())} latest={mgr.latest_step()}")
    for wanted in args.restore_steps.split(","):
      step = mgr.latest_step() if wanted == "latest" else int(wanted)
      restored = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
      ok = ok and not problems
      detail = "; ".join(problems)[:500] or "-"
      emit(f"RESULT process={me} step={mgr.last_restore.step} tier={mgr.last_restore.tier} "
           f"ok={int(not problems)} leaves={LEAVES} detail={detail}")
    emit(f"STEPS-AFTER process={me} all={fmt(mgr.all_steps())} latest={mgr.latest_step()}")
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_open(args) -> int:
  """Only opens the manager (on --local-dir, which may be shared by mistake) and closes it."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  try:
    with manager(args, mesh):
      pass
  except Exception as e:  # noqa: BLE001 - reported to the test
    raised(e)
    return EXIT_RAISED
  emit("DONE")
  return 0


def cmd_force_old(args) -> int:
  """Saves steps [0, --steps), then every process forces a save of the older --old-step;
  prints what save returned, the step lists and this node's LKG links."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed
  from orbax_mtc.local import restore_links as lkg

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with manager(args, mesh) as mgr:
    save_loop(args, mgr, mesh, 0, args.steps)
    state = make_state(mesh, args.rows, args.seed, args.old_step)
    saved = mgr.save(args.old_step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)),
                     force=True)
    mgr.wait_until_finished()
    folder = pathlib.Path(mgr.local_directory)
    links = ",".join(f"{e.step}->{os.readlink(folder / e.name)}"
                     for e in lkg.list_entries(folder)) or "-"
    emit(f"FORCED process={me} saved={int(saved)} all={fmt(mgr.all_steps())} links={links}")
    committed(args, mgr)
  emit("DONE")
  return 0


def cmd_mirror(args) -> int:
  """The parent-style form with a RAM tier that mirrors the parent's steps (Orbax keeps one:
  max_to_keep=1) and peer copies moved in 1 MiB chunks: saves [0, --steps) (restoring
  first if --restore-first), then prints the folders and the peer copies held."""
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  hooks.small_replication_calls(1 << 20)
  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with mtc.CheckpointManager(
      args.persistent_dir,
      options=ocp.CheckpointManagerOptions(max_to_keep=1, save_interval_steps=1),
      local_directory=distributed.local_directory(), global_mesh=mesh,
      replication_options=mtc.ReplicationOptions(replica_axis="data", chunk_mib=1)) as mgr:
    start = 0
    if args.restore_first:
      step = mgr.latest_step()
      restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract_state(mesh, args.rows))))
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
      ok = not problems
      emit(f"RESULT process={me} step={step} tier={mgr.last_restore.tier} ok={int(ok)} "
           f"leaves={LEAVES} detail={'; '.join(problems)[:300] or '-'}")
      start = step + 1
    for step in range(start, args.steps):
      state = make_state(mesh, args.rows, args.seed, step)
      train_step(state)
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mgr.wait_until_finished()
    copies = ",".join(f"{a}:{b}" for a, b in hooks.peer_copies(mgr)) or "-"
    emit(f"MIRROR process={me} all={fmt(mgr.all_steps())} copies={copies}")
    committed(args, mgr)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH
