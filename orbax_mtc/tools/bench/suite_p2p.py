"""Orbax's P2P manager (`experimental.emergency.p2p.CheckpointManager`) in `orbax-mtc bench
suite`: its save, its restore from the process's own folder and, with two replicas, the
recovery of a node whose folder is wiped (its files fetched from a peer over the P2P manager's
own sockets). `suite` runs it in a job of its own (suite_worker)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from orbax_mtc.tools.bench.suite_job import Job


def _manager(job: Job, folder: Path, persistent: Path, abstract: Any):
  """Orbax's P2P manager with the schedule the other contenders use: RAM every step, one step
  kept, persistent saves never due in the run."""
  from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
  from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options

  options = p2p_options.CheckpointManagerOptions(
      local=p2p_options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
      persistent=p2p_options.PersistentCheckpointOptions(save_interval_steps=10**9,
                                                         max_to_keep=1),
      replica_axis_index=0)  # the mesh's "data" axis
  folder.mkdir(parents=True, exist_ok=True)  # its managers do not create their folders
  persistent.mkdir(parents=True, exist_ok=True)
  return p2p.CheckpointManager(job.mesh, abstract, folder, persistent, options=options)


def measure(job: Job, mib: int, state: Any, abstract: Any, res: dict) -> None:
  """Orbax's experimental.emergency.p2p.CheckpointManager: save to RAM, restore from the own
  folder and, with two replicas, the recovery of the last node after its folder is wiped
  (timed from the new manager's construction, where its peer fetch starts, to the restore's
  end)."""
  import jax
  import orbax.checkpoint as ocp
  from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args

  def restore_args():
    return p2p_args.Composite(state=ocp.args.PyTreeRestore(abstract))

  folder = job.local_root / f"p2p-{mib}"
  persistent = Path(job.args.persistent) / f"p2p-{mib}"
  step = job.args.reps + 1  # the newest step saved below
  with _manager(job, folder, persistent, abstract) as manager:
    job.save_restore_reps(
        res, "p2p", state,
        lambda s, current: manager.save(
            s, args=p2p_args.Composite(state=ocp.args.PyTreeSave(current))),
        manager.wait_until_finished,
        lambda s: manager.restore(s, args=restore_args()).state, "Orbax P2P")
  if job.replicas > 1:
    for rep in range(job.args.reps):
      job.barrier()
      if job.me == job.n - 1:  # the replaced node: its RAM folder is gone
        shutil.rmtree(folder)
      job.barrier()

      built: list[float] = []

      def recover(built: list[float] = built) -> Any:
        start = time.perf_counter()
        with _manager(job, folder, persistent, abstract) as fresh:
          built.append(time.perf_counter() - start)
          assert fresh.latest_step() == step, (fresh.latest_step(), step)
          return jax.block_until_ready(fresh.restore(None, args=restore_args()).state)

      restored = job.measure(res, "p2p_recovery_s", recover, warm=True)
      job.record(res, "p2p_recovery_build_s", built[0])
      if rep == 0 and not job.equal(restored, state):
        raise AssertionError("Orbax P2P recovery is not bit-exact")
      del restored
  job.barrier()
  shutil.rmtree(folder, ignore_errors=True)
  if job.me == 0:
    shutil.rmtree(persistent, ignore_errors=True)
