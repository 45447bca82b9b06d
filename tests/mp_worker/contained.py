"""Sub-commands for faults that must end the same way on every process (issue 40): delete
(a persistent step one process's view lacks), clock (backups by minutes where one process
reads the last backup's commit time an hour earlier)."""

from __future__ import annotations

from .common import EXIT_RAISED, fmt, make_mesh, make_state, manager, raised
from .events import emit


def cmd_delete(args) -> int:
  """Opens the manager on a saved run; on --lag-process, Orbax's cached view of the
  persistent directory loses --step (as after a finalize that failed there); then every
  process calls delete(--step) and prints the steps it then sees (or what it raised)."""
  import jax

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with manager(args, mesh) as mgr:
    if me == args.lag_process:
      mgr._checkpoints.delete_if(lambda info: info.step == args.step)  # Orbax's cache
    emit(f"BEFORE process={me} all={fmt(mgr.all_steps())} "
         f"orbax={fmt(mgr._form.persistent.steps())} primary={int(mgr.in_primary_slice)}")
    try:
      mgr.delete(args.step)
    except Exception as e:  # noqa: BLE001 - reported to the test
      raised(e)
      return EXIT_RAISED
    emit(f"DELETED process={me} all={fmt(mgr.all_steps())} "
         f"orbax={fmt(mgr._form.persistent.steps())}")
  emit("DONE")
  return 0


def cmd_clock(args) -> int:
  """Backups every --backup-minutes, counted from the newest persistent step's commit time,
  which --lag-process reads an hour earlier than it is; every process saves --step to RAM
  and prints the persistent steps once Orbax is done."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed
  from orbax_mtc.persistent.tier import PersistentTier

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  if me == args.lag_process:
    real = PersistentTier.commit_time
    PersistentTier.commit_time = lambda tier, step: real(tier, step) - 3600.0
  with manager(args, mesh) as mgr:
    try:
      saved = mgr.save(args.step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
          make_state(mesh, args.rows, args.seed, args.step))))
      mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - reported to the test
      raised(e)
      return EXIT_RAISED
    emit(f"CLOCK process={me} saved={int(saved)} persistent={fmt(mgr._form.persistent.steps())}")
  emit("DONE")
  return 0


def cmd_train_die(args) -> int:
  """Trains and saves to RAM every step (a global reduction per step, as a real training
  step); --die-process SIGKILLs itself right after saving --die-at-step. The survivors'
  errors propagate as in a training script (no os._exit): each prints RAISED and ends
  through the interpreter's normal exit."""
  import os
  import signal

  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  from .common import train_step

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with manager(args, mesh) as mgr:
    for step in range(args.steps):
      state = make_state(mesh, args.rows, args.seed, step)
      try:
        train_step(state)
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
      except Exception as e:
        raised(e)
        raise
      if step == args.die_at_step and me == args.die_process:
        emit(f"DYING process={me} step={step}")
        os.kill(os.getpid(), signal.SIGKILL)
  emit("DONE")
  return 0


def cmd_policies(args) -> int:
  """Runs every Orbax save policy on --tier (see `policies`), each with fresh folders under
  this process's local directory and --persistent-dir; prints one POLICY line per policy."""
  import pathlib

  import jax

  from orbax_mtc import distributed

  from . import policies
  from .common import abstract_state

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  local_root = pathlib.Path(args.local_dir or distributed.local_directory())
  for kind, table, run in (("POLICY", policies.policies(), policies.run),
                           ("KEPT", policies.preservations(), policies.run_preservation)):
    for name in table:
      folder = f"{args.tier}-{kind.lower()}-{name}"
      held = run(args.tier, name, local_root / folder,
                 pathlib.Path(args.persistent_dir) / folder, mesh,
                 abstract_state(mesh, args.rows),
                 lambda step: make_state(mesh, args.rows, args.seed, step))
      emit(f"{kind} process={me} tier={args.tier} name={name} steps={fmt(held)}")
  emit("DONE")
  return 0


def cmd_empty_restore(args) -> int:
  """Saves steps 0-2 (persistent every --persistent-interval), waits, then empties this
  process's local directory under the live manager (Orbax's emergency suite does) and calls
  restore(2); prints RESULT or RAISED. With --fail-process, that process's own code raises
  instead of restoring, so it leaves the manager (close) while the others restore."""
  import pathlib
  import shutil
  import time

  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  from .common import abstract_state, compare_state

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  local = pathlib.Path(args.local_dir or distributed.local_directory())
  try:
    with manager(args, mesh) as mgr:
      for step in range(3):
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
            make_state(mesh, args.rows, args.seed, step))))
      mgr.wait_until_finished()
      # Everything, exactly as the suite's test_utils.empty_directory: rmtree of whatever
      # is_dir() calls a folder (rmtree refuses a symlink to one: the LKG links must not be).
      for entry in local.iterdir():
        if entry.is_dir():
          shutil.rmtree(entry)
        else:
          entry.unlink()
      if me == args.fail_process:
        raise RuntimeError("the training script failed before its restore (injected)")
      restored = mgr.restore(2, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract_state(mesh, args.rows))))
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, 2))
      emit(f"RESULT process={me} step={mgr.last_restore.step} tier={mgr.last_restore.tier} "
           f"ok={int(not problems)} leaves=0 detail={'; '.join(problems)[:300] or '-'}")
  except Exception as e:  # noqa: BLE001 - reported to the test
    raised(e)
    # The launcher kills every process once one exits non-zero: stay until every process
    # has reported (a marker each, in the shared folder; bounded), so none is cut short.
    reported = pathlib.Path(args.persistent_dir).parent / "raised"
    reported.mkdir(exist_ok=True)
    (reported / str(me)).touch()
    deadline = time.monotonic() + 60
    while len(list(reported.iterdir())) < jax.process_count() and time.monotonic() < deadline:
      time.sleep(0.05)
    emit("DONE")
    return EXIT_RAISED
  emit("DONE")
  return 0
