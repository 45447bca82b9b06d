"""Managed mode: GKE's multi-tier checkpointing replicator copies and backs up the RAM steps.

  protocol  the file protocol shared with the replicator daemon: `replicator.yaml`,
            `replicator.errors` / `replicator.failed`, the `*.restore` entries, `ReplicatorError`
  setup     `initialize_multi_tier_checkpointing`: joins `jax.distributed` and makes the
            `replicator.yaml` handshake (as Orbax's function of that name)
  options   `ReplicatorCheckpointManagerOptions`

`ReplicatorCheckpointManager` itself composes `orbax_mtc.CheckpointManager`, which uses this
package, so it lives above both: `orbax_mtc/replicator_manager.py`.
"""
