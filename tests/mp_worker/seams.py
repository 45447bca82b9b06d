"""Sub-commands of the restore-seam tests (tests/test_restore_seams.py and
tests/test_restore_campaign.py): restore-exit, restore-die, items, restore-transient, pos.

  restore-exit       restore(None) with explicit args, print RESTORED, and `os._exit(0)` the
                     instant restore() returns, or as the first RAM write (the write-back)
                     starts, whichever comes first (`hooks.exit_at_first_write`): a crash
                     right after a restore.
  restore-die        restore(None) with explicit args; --die-process is SIGKILLed as it first
                     reads a RAM step (`hooks.die_at_first_read`): a kill -9 during a restore.
  items              two array items, `params` and `opt` (each a state of its own seed), saved
                     together; a restore of the items --restore-items names only.
  restore-transient  restore(None) while `jax.device_put` raises a transient (non-damage) error
                     on --fault-process (`hooks.transient_device_put`); RESULT or RAISED.
  pos                the state and a per-process JSON item (`ProcessJsonSave`, no Grain) saved
                     together; restores with or without it, by restore(None) or
                     restore(latest_step()).
"""

from __future__ import annotations

import os
import sys

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
    train_step,
)
from .events import emit

OPT_SEED = 1000  # the opt item's seed: --seed + OPT_SEED


def _exit_now(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def cmd_restore_exit(args) -> int:
  """restore(None) with Composite(state=PyTreeRestore(abstract)); prints RESTORED (step and
  tier, no comparison: nothing may run between the return and the exit) and exits at once,
  without close(), as a process killed the instant restore() returned. The first RAM write
  (the write-back, on the writer thread or not) ends the process as it starts (WRITE-EXIT):
  whatever the timing of the write-back, the process dies before it wrote a byte."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  mgr = manager(args, mesh)
  hooks.exit_at_first_write(jax.process_index())
  mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
  info = mgr.last_restore
  emit(f"RESTORED process={jax.process_index()} step={info.step} tier={info.tier}")
  _exit_now(0)
  return 0  # not reached


def _item_seed(args, name: str) -> int:
  return args.seed + (OPT_SEED if name == "opt" else 0)


def cmd_items(args) -> int:
  """Restores the items --restore-items names (if any) and compares each, then saves steps
  [start, --steps) with both items, `params` and `opt`, then closes."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with manager(args, mesh) as mgr:
    start = args.start
    names = [n for n in args.restore_items.split(",") if n]
    if names:
      try:
        restored = mgr.restore(None, args=ocp.args.Composite(**{
            name: ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))
            for name in names}))
      except Exception as e:  # noqa: BLE001 - reported to the test
        raised(e)
        committed(args, mgr)
        _exit_now(EXIT_RAISED)
      info = mgr.last_restore
      step = info.step
      problems: list[str] = []
      if restored is None:
        problems.append("nothing restored")
      else:
        for name in names:
          problems += [f"{name}: {p}" for p in compare_state(
              restored[name], make_state(mesh, args.rows, _item_seed(args, name), step))]
      ok = not problems
      detail = "; ".join(problems)[:1500].replace("\n", " ") or "-"
      emit(f"RESULT process={me} step={step} tier={info.tier} ok={int(ok)} leaves={LEAVES} "
           f"items={','.join(names)} detail={detail}")
      if step is not None:
        start = step + 1
    for step in range(start, args.steps):
      params = make_state(mesh, args.rows, _item_seed(args, "params"), step)
      opt = make_state(mesh, args.rows, _item_seed(args, "opt"), step)
      train_step(params)
      mgr.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                             opt=ocp.args.PyTreeSave(opt)))
      if step % args.persistent_interval == 0:
        mgr.wait_until_finished()  # every scheduled backup lands (no compute between saves)
    mgr.wait_until_finished()
    committed(args, mgr)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_restore_transient(args) -> int:
  """restore(None) with explicit args while --fault-process's `jax.device_put`, called from the
  library, raises RuntimeError('RESOURCE_EXHAUSTED ...') (a transient device error, not damage:
  the bytes on disk are fine). Prints RESULT (compared after the fault is undone) or RAISED,
  then COMMITTED, and exits without close() when the restore raised."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  mgr = manager(args, mesh)
  undo = hooks.transient_device_put() if me == args.fault_process else (lambda: 0)
  try:
    restored = mgr.restore(None, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
  except Exception as e:  # noqa: BLE001 - reported to the test
    fired = undo()
    raised(e)
    emit(f"INJECTED process={me} calls={fired}")
    committed(args, mgr)
    _exit_now(EXIT_RAISED)
  fired = undo()
  emit(f"INJECTED process={me} calls={fired}")
  info = mgr.last_restore
  problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, info.step))
  detail = "; ".join(problems)[:1500].replace("\n", " ") or "-"
  emit(f"RESULT process={me} step={info.step} tier={info.tier} ok={int(not problems)} "
       f"leaves={LEAVES} detail={detail}")
  mgr.close()
  committed(args, mgr)
  emit("DONE")
  return 0 if not problems else EXIT_MISMATCH


def _position(step: int, me: int) -> dict:
  return {"step": step, "process": me}


def cmd_pos(args) -> int:
  """The state and a per-process JSON item `pos` ({"step": s, "process": p}).

  Prints STEPS (all_steps, latest_step); then, by --restore:
    none         no restore;
    state        restore(None) of the state alone (a per-process item left out, as
                 docs/iterators.md allows);
    none-pos     restore(None) of the state and `pos`;
    latest-pos   restore(latest_step()) of the state and `pos`;
  RESULT (state bit for bit, and `pos` this process's own of that step) or RAISED (then
  COMMITTED and exit 7 without close()). Then saves steps [start, --steps) (start: after the
  restored step) with both items, and prints COMMITTED.
  """
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with manager(args, mesh) as mgr:
    latest = mgr.latest_step()
    emit(f"STEPS process={me} all={fmt(mgr.all_steps())} latest={latest}")
    start = args.start
    if args.restore != "none":
      items = {"state": ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))}
      if args.restore != "state":
        items["pos"] = mtc.ProcessJsonRestore()
      wanted = latest if args.restore == "latest-pos" else None
      try:
        restored = mgr.restore(wanted, args=ocp.args.Composite(**items))
      except Exception as e:  # noqa: BLE001 - reported to the test
        raised(e)
        committed(args, mgr)
        _exit_now(EXIT_RAISED)
      info = mgr.last_restore
      step = info.step
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
      if "pos" in items and restored.pos != _position(step, me):
        problems.append(f"pos {restored.pos} != {_position(step, me)}")
      ok = not problems
      detail = "; ".join(problems)[:1500].replace("\n", " ") or "-"
      emit(f"RESULT process={me} step={step} tier={info.tier} ok={int(ok)} leaves={LEAVES} "
           f"detail={detail}")
      start = step + 1
    for step in range(start, args.steps):
      state = make_state(mesh, args.rows, args.seed, step)
      train_step(state)
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                             pos=mtc.ProcessJsonSave(_position(step, me))))
      if step % args.persistent_interval == 0:
        mgr.wait_until_finished()
    mgr.wait_until_finished()
    committed(args, mgr)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_restore_die(args) -> int:
  """restore(None) with explicit args; --die-process is SIGKILLed as it first reads a RAM
  step inside restore() (a kill -9 during a restore). The others are left in the restore's
  next agreement until the launcher ends them; they must not restore anything else first."""
  import signal

  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  mgr = manager(args, mesh)
  if me == args.die_process:
    hooks.die_at_first_read(me, signal.SIGKILL)
  restored = mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
  info = mgr.last_restore
  problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, info.step))
  emit(f"RESULT process={me} step={info.step} tier={info.tier} ok={int(not problems)} "
       f"leaves={LEAVES} detail={'; '.join(problems)[:300] or '-'}")
  _exit_now(0)
  return 0  # not reached
