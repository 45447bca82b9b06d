"""Managed mode set-up: joining `jax.distributed` from GKE's `jax-init-info.txt` and the
`replicator.yaml` handshake, as Orbax's `initialize_multi_tier_checkpointing` does, with peers
for jobs without data-parallel replicas too.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from absl import logging

from orbax_mtc import distributed, topology
from orbax_mtc.managed import protocol as replicator_protocol
from orbax_mtc.options import CheckpointManagerOptions


def peers_for(node_rank: int, nodes: int, num_slices: int, peers_per_node: int | None
              ) -> tuple[tuple[int, ...] | None, int | None]:
  """(peer_ranks, peers_per_node) for replicator.yaml; exactly one is not None.

  With several slices (data-parallel replicas) the peers are the nodes at the same index in
  every other slice (Orbax's rule). With one slice Orbax would write no peers; we ask the
  replicator for `peers_per_node` (default 1) so a job without replicas is still protected.
  """
  if peers_per_node is not None:
    return None, peers_per_node
  if num_slices > 1:
    per_slice = nodes // num_slices
    index = node_rank % per_slice
    return tuple(s * per_slice + index for s in range(num_slices)
                 if s * per_slice + index != node_rank), None
  if nodes == 1:
    return (), None
  return None, 1


def config_for_manager(options: CheckpointManagerOptions, topo: topology.Topology | None,
                       node_rank: int, nodes: int) -> replicator_protocol.ReplicatorConfig:
  """What a managed-mode manager writes when no `initialize_multi_tier_checkpointing` ran."""
  managed = options.managed
  replicas = len(topo.replicas) if topo is not None else 1
  if managed.peers_per_node is not None:
    peer_ranks, per_node = None, managed.peers_per_node
  elif replicas > 1 and topo is not None:
    peer_ranks, per_node = tuple(topo.twins[node_rank]), None
  elif nodes > 1:
    peer_ranks, per_node = None, options.replication.peers_per_node
  else:
    peer_ranks, per_node = (), None
  persistent = options.persistent
  return replicator_protocol.ReplicatorConfig(
      job_name=options.job_name, node_rank=node_rank, nodes=nodes,
      data_parallelism=managed.data_parallelism or replicas, peer_ranks=peer_ranks,
      peers_per_node=per_node, backup_interval_minutes=persistent.backup_interval_minutes,
      backup_interval_steps=(None if persistent.backup_interval_minutes is not None
                             else persistent.save_interval_steps))


def _slice_count() -> int:
  return len({getattr(d, "slice_index", 0) for d in jax.devices()})


def initialize_multi_tier_checkpointing(
    local_checkpoint_directory: str | os.PathLike[str], *,
    backup_interval_minutes: float | None = None, backup_interval_steps: int | None = None,
    num_slices: int | None = None, run_name: str | None = None,
    data_parallelism: int | None = None, jax_initialization_timeout_seconds: int = 900,
    jax_shutdown_timeout_seconds: int = 300, use_mtc_process_ids: bool = True,
    use_colocated_python: bool = False, devices: object = None,
    peers_per_node: int | None = None, handshake_timeout_seconds: float = 300.0,
    poll_seconds: float = 0.1) -> int | None:
  """Joins `jax.distributed` and makes the replicator handshake; returns the step the
  replicator's restore entry names for this process (None: nothing to restore).

  Orbax's function of this name, same arguments and defaults (backup every 30 minutes when no
  interval is given; the run name from JOBSET_NAME), plus `peers_per_node`,
  `handshake_timeout_seconds` and `poll_seconds`. With `use_mtc_process_ids` the process id
  and coordinator come from `<local>/jax-init-info.txt` (waited for); an already initialised
  `jax.distributed` is kept. Colocated Python (Pathways) is not supported. Build the manager
  with `CheckpointManagerOptions(mode="managed")` afterwards: it restores that step.
  """
  if use_colocated_python or devices is not None:
    raise ValueError("initialize_multi_tier_checkpointing: colocated Python (Pathways) is not "
                     "supported by orbax-mtc; run one JAX process per host "
                     "(use_colocated_python=False, devices=None).")
  local_directory = Path(local_checkpoint_directory)
  if backup_interval_minutes is None and backup_interval_steps is None:
    backup_interval_minutes = 30
  run_name = run_name or os.environ.get("JOBSET_NAME")
  if not run_name:
    raise ValueError("initialize_multi_tier_checkpointing needs run_name= (or JOBSET_NAME in "
                     "the environment, as GKE's JobSet sets it).")
  if not distributed.is_initialized():
    if use_mtc_process_ids:
      process_id, coordinator = replicator_protocol.read_jax_init_info(
          local_directory, timeout_s=jax_initialization_timeout_seconds)
      logging.info("orbax-mtc: joining jax.distributed at %s as process %d (from %s)",
                   coordinator, process_id, replicator_protocol.JAX_INIT_INFO_FILE)
      distributed.join(coordinator, process_id, timeout_s=jax_initialization_timeout_seconds,
                       shutdown_timeout_s=jax_shutdown_timeout_seconds)
    else:
      distributed.initialize(timeout_s=jax_initialization_timeout_seconds)
  nodes, node_rank = jax.process_count(), jax.process_index()
  slices = num_slices if num_slices and num_slices > 0 else _slice_count()
  if nodes % slices:
    raise ValueError(f"{nodes} processes do not divide into num_slices={slices} slices.")
  peer_ranks, per_node = peers_for(node_rank, nodes, slices, peers_per_node)
  config = replicator_protocol.ReplicatorConfig(
      job_name=run_name, node_rank=node_rank, nodes=nodes,
      data_parallelism=data_parallelism if data_parallelism and data_parallelism > 0
      else slices, peer_ranks=peer_ranks, peers_per_node=per_node,
      backup_interval_minutes=backup_interval_minutes,
      backup_interval_steps=backup_interval_steps)
  return replicator_protocol.connect(local_directory, config, distributed.worker_index(),
                                     timeout_s=handshake_timeout_seconds, poll_s=poll_seconds)
