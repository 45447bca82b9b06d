"""Sub-commands where something goes wrong: fault (one injected fault, see
`hooks.install_fault`), mismatch (a restore target of another layout), outage (the GCS
server taken away and back)."""

from __future__ import annotations

import os
import pathlib
import sys

from . import hooks
from .common import (
    EXIT_MISMATCH,
    EXIT_RAISED,
    LEAVES,
    abstract_state,
    committed,
    compare_state,
    make_mesh,
    make_state,
    manager,
    raised,
    restore_and_check,
    save_loop,
    train_step,
)
from .events import emit


def cmd_fault(args) -> int:
  """Restores if asked, injects one fault on --fault-process (see `hooks.install_fault`), saves
  steps up to --steps; prints RAISED for an exception the manager raised, then the folders."""
  import jax

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  code = 0
  with manager(args, mesh) as mgr:
    after_restore = hooks.install_fault(args, mgr, me)
    start = 0
    try:
      if args.restore_first:
        step, ok = restore_and_check(args, mgr, mesh)
        code = 0 if ok else EXIT_MISMATCH
        start = 0 if step is None else step + 1
        after_restore()
      save_loop(args, mgr, mesh, start, args.steps)
    except Exception as e:  # noqa: BLE001 - reported to the test
      raised(e)
      committed(args, mgr)
      # The error may leave an agreement behind on purpose (a write that failed): close
      # without waiting for more, as a training job that dies on this error would.
      os._exit(EXIT_RAISED)
  emit("DONE")
  return code


def cmd_mismatch(args) -> int:
  """restore(None) with the shardings of another mesh layout (same shapes and dtypes: the
  device order of the mesh reversed); prints the RESULT (compared bit for bit on the new
  layout) or what it raised, then the folders."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[::-1]
  other = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(mesh.devices.shape),
                            mesh.axis_names)
  with manager(args, mesh) as mgr:
    try:
      restored = mgr.restore(None, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract_state(other, args.rows))))
      info = mgr.last_restore
      problems = compare_state(restored.state, make_state(other, args.rows, args.seed,
                                                          info.step))
      detail = "; ".join(problems)[:500].replace("\n", " ") or "-"
      emit(f"RESULT process={jax.process_index()} step={info.step} tier={info.tier} "
           f"ok={int(not problems)} leaves={LEAVES} detail={detail}")
    except Exception as e:  # noqa: BLE001 - reported to the test
      raised(e)
    committed(args, mgr)
  emit("DONE")
  return 0


_PHASES = ("", "frozen", "held", "up", "stop")


def cmd_outage(args) -> int:
  """Trains and saves every step while the test takes the GCS server away and back.

  Process 0 reads the phase the test writes into --control and every process learns it from
  a broadcast at the same step. Prints `PHASE name=... step=...` when the phase changes and
  `BACKUP step=... state=... at=...` when `mgr.last_backup` changes.
  """
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  from orbax_mtc import distributed

  distributed.initialize()
  hooks.faster_gcsfs_retries(0.1)
  mesh = make_mesh()
  control = pathlib.Path(args.control)
  me = jax.process_index()
  mgr = manager(args, mesh)
  phase, seen, reported = 0, set(), 0
  for step in range(args.max_steps):
    state = make_state(mesh, args.rows, args.seed, step)
    train_step(state)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    for info in [*list(mgr.backup_history)[reported:], mgr.last_backup]:
      if info is not None and (info.step, info.state) not in seen:
        seen.add((info.step, info.state))
        emit(f"BACKUP step={info.step} state={info.state} at={step}")
    reported = len(mgr.backup_history)
    text = control.read_text().strip() if me == 0 and control.exists() else ""
    code = _PHASES.index(text) if text in _PHASES else 0
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if code != phase:
      phase = code
      emit(f"PHASE name={_PHASES[phase]} step={step}")
    if _PHASES[phase] == "stop":
      break
  mgr.wait_until_finished()
  info = mgr.last_backup
  emit(f"BACKUP step={info.step} state={info.state} at=end")
  mgr.close()
  committed(args, mgr)
  emit("DONE")
  sys.stdout.flush()
  sys.stderr.flush()
  # orbax-checkpoint 0.12.8 leaves helper threads of a failed save waiting up to its 300 s
  # coordination timeout, and they hold the interpreter at exit; the job's work is done.
  os._exit(0)
