"""The preempt sub-command: train and save until a SIGTERM makes every process save on demand.

Its timing hooks (a write or a restore that waits for the notice, an on-demand write that
waits for a go file) live in `hooks`.
"""

from __future__ import annotations

import sys

from . import hooks
from .common import (
    EXIT_BAD_ONDEMAND,
    EXIT_MISMATCH,
    EXIT_NO_PREEMPTION,
    EXIT_USAGE,
    committed,
    make_mesh,
    make_state,
    manager,
    restore_and_check,
    train_step,
)
from .events import emit


def _ondemand_fields(mgr) -> str:
  info = getattr(mgr, "last_ondemand", None)
  if info is None:
    return "info=none"
  return (f"info_step={info.step} persistent={int(bool(info.persistent))} "
          f"total={info.seconds.get('total', -1):.3f}")


def _usage_error(args) -> str | None:
  if args.exit_after and args.self_exit:
    return "--exit-after and --self-exit exclude each other"
  if args.hook == "ondemand-write" and not args.marker_dir:
    return "--hook ondemand-write needs --marker-dir"
  if args.hook == "write" and args.hook_step is None:
    return "--hook write needs --hook-step"
  if args.stride < 1 or args.max_steps < 1 or args.after_steps < 0:
    return "--stride and --max-steps must be >= 1, --after-steps >= 0"
  return None


def cmd_preempt(args) -> int:
  """Train and save until a preemption notice (SIGTERM) makes every process save on demand.

  Steps run F, F+K, ... (F = --first-step, K = --stride) or, after a restore of step R, R+K,
  R+2K, ...; each is a training step (an all-reduce), `reached_preemption(step)`, then
  `save(step)`. At the step all processes agreed on (`reached_preemption` True) the save is
  the on-demand one:
    --exit-after  the manager exits the process (status 0) inside that save();
    --self-exit   the loop stops once `mgr.should_exit()` says so (EXITING);
    otherwise     training goes on for --after-steps more steps (DONE).
  Every `reached_preemption` is asked twice (before and after save) and must not change.
  --hook restore|write|ondemand-write installs `hooks.install_restore_hook` or
  `hooks.install_write_hook`.
  """
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  problem = _usage_error(args)
  if problem:
    print(problem, file=sys.stderr)
    return EXIT_USAGE

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ondemand_steps: set[int] = set()
  with manager(args, mesh, exit_after_ondemand_checkpoint=True if args.exit_after else None,
               ondemand_grace_seconds=args.grace_seconds) as mgr:
    if args.hook == "restore":
      hooks.install_restore_hook(mgr, me)
    restored, ok = restore_and_check(args, mgr, mesh)
    if not ok:
      return EXIT_MISMATCH
    if args.hook in ("write", "ondemand-write"):
      hooks.install_write_hook(args, mgr, me, ondemand_steps)
    step = args.first_step if restored is None else restored + args.stride
    preempted_at: int | None = None
    ready = False
    for _ in range(args.max_steps):
      state = make_state(mesh, args.rows, args.seed, step)
      train_step(state)
      pre = mgr.reached_preemption(step)
      if pre:
        if preempted_at is not None:
          emit(f"ERROR process={me} step={step} detail=second sync point (first at "
               f"{preempted_at})")
          return EXIT_BAD_ONDEMAND
        preempted_at = step
        ondemand_steps.add(step)
        emit(f"PREEMPTED process={me} step={step}")
      items = {"state": ocp.args.PyTreeSave(state)}
      if args.dataset_dir:
        items["dataset"] = ocp.args.JsonSave({"process": me, "step": step})
      mgr.save(step, args=ocp.args.Composite(**items))
      if not ready:
        ready = True
        emit(f"READY process={me} step={step}")
      again = mgr.reached_preemption(step)
      if again != pre:
        emit(f"ERROR process={me} step={step} detail=reached_preemption said {pre} before "
             f"save and {again} after")
        return EXIT_BAD_ONDEMAND
      if pre:
        emit(f"ONDEMAND-SAVED process={me} step={step} {_ondemand_fields(mgr)}")
        if args.exit_after:
          emit(f"ERROR process={me} step={step} detail=save() returned under "
               "exit_after_ondemand_checkpoint")
          return EXIT_BAD_ONDEMAND
      if args.self_exit:
        if mgr.should_exit():
          mgr.wait_until_finished()
          emit(f"EXITING process={me} step={step}")
          return 0
        if pre:
          emit(f"ERROR process={me} step={step} detail=should_exit() False after the "
               "on-demand save")
          return EXIT_BAD_ONDEMAND
      elif preempted_at is not None and step >= preempted_at + args.after_steps * args.stride:
        mgr.wait_until_finished()
        committed(args, mgr)
        emit(f"DONE process={me} step={step}")
        return 0
      step += args.stride
  emit(f"NO-PREEMPTION process={me} step={step}")
  return EXIT_NO_PREEMPTION
