"""Managed mode inside the manager: the replicator handshake and its restore entry.

Under GKE's multi-tier checkpointing replicator the manager writes only its RAM folder. At
start it makes the `replicator.yaml` handshake (unless `initialize_multi_tier_checkpointing`
made it in this process) and reads the step this worker's `.restore` entry names; the first
`restore(None)` honours that step when every process's entry names it and can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import logging

from orbax_mtc import agreement, topology
from orbax_mtc.managed import protocol, setup
from orbax_mtc.options import CheckpointManagerOptions
from orbax_mtc.summary import Summary


def connect(local_directory: Any, options: CheckpointManagerOptions,
            topo: topology.Topology | None, process_index: int, process_count: int,
            worker_index: int, summarize: Callable[[Any, str], Summary]) -> int:
  """The replicator handshake, agreed: a failure on any process is raised on every one.

  Args:
    local_directory: this node's RAM folder.
    options: the manager's options (`managed`, `job_name`, ...).
    topo: the job's topology (peers), or None.
    process_index: this process.
    process_count: processes in the job.
    worker_index: this process's index inside its host.
    summarize: summarizes one agreement record of every process (summary.py).

  Returns:
    The step this worker's restore entry names (0: the replicator has nothing).

  Raises:
    protocol.ReplicatorError: the handshake failed on some process.
    TimeoutError, OSError: it failed on this one.
  """
  done, step = protocol.handshake_result(local_directory)
  error: Exception | None = None
  if not done:
    config = setup.config_for_manager(options, topo, process_index, process_count)
    try:
      step = protocol.connect(local_directory, config, worker_index,
                              timeout_s=options.managed.timeout_seconds,
                              poll_s=options.managed.poll_seconds)
    except (protocol.ReplicatorError, TimeoutError, OSError) as e:
      error = e
  # Every process learns of a failure anywhere and stops too, instead of waiting in the
  # next collective for a process that has gone.
  found = summarize(agreement.StartRecord(fault=agreement.Fault.of(error)),
                    "the replicator handshake")
  if error is not None:
    raise error
  if found.own_faults:
    raise protocol.ReplicatorError(
        f"The replicator handshake failed on process(es) {found.own_faults}: " + "; ".join(
            f"process {p}: {f.kind}: {f.message}" for p, f in sorted(found.faults.items())))
  return step or 0


def entry_step(mine: int, own_steps: list[int],
               summarize: Callable[[Any, str], Summary]) -> int | None:
  """The step every process's restore entry names (collective).

  Returns:
    0 when all say nothing to restore; None when they disagree or some process cannot read
    the step (then the usual restore plan).
  """
  found = summarize(agreement.EntryRecord(step=mine, readable=mine in own_steps),
                    "the replicator's restore entries")
  lowest, highest = found.ranges["step"]
  agreed = protocol.agree((lowest, highest))
  if agreed is None:
    logging.warning("orbax-mtc: the replicator's restore entries disagree across processes "
                    "(steps %d to %d); restoring the newest step every process holds "
                    "instead.", lowest, highest)
  unreadable = found.false("readable")
  if agreed and unreadable:
    logging.warning("orbax-mtc: the replicator named step %d but process(es) %s cannot read "
                    "it; restoring the newest step every process holds instead.", agreed,
                    unreadable)
    return None
  return agreed
