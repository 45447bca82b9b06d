"""orbax-mtc: multi-tier checkpointing for JAX, as an Orbax CheckpointManager subclass.

Public API::

  import orbax_mtc as mtc
  mgr = mtc.CheckpointManager(local_directory, persistent_directory, global_mesh,
                              abstract_state, options=mtc.CheckpointManagerOptions(...))
  # Orbax's replicator manager (GKE multi-tier checkpointing), Orbax's signature:
  mgr = mtc.ReplicatorCheckpointManager(
      local_directory, options=mtc.ReplicatorCheckpointManagerOptions(...), global_mesh=mesh)
  # Per-process items (a data iterator's position) beside the arrays, in every tier:
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         iter=mtc.ProcessJsonSave(position)))
"""

from orbax_mtc import distributed
from orbax_mtc.errors import (
    AbstractStateMismatchError,
    AgreementTimeoutError,
    BackupError,
    CheckpointError,
    CorruptStepError,
    LocalDirectoryInUseError,
    LocalDirectoryTakenOverError,
    LocalTierError,
    ManifestError,
    MissingItemError,
    ReplicatorError,
)
from orbax_mtc.managed.replicator_options import ReplicatorCheckpointManagerOptions
from orbax_mtc.managed.setup import initialize_multi_tier_checkpointing
from orbax_mtc.manager import CheckpointManager, RestoreInfo
from orbax_mtc.options import (
    CheckpointManagerOptions,
    LocalCheckpointOptions,
    ManagedOptions,
    MultiprocessingOptions,
    PersistentCheckpointOptions,
    ReplicationOptions,
)
from orbax_mtc.process_state import ProcessJsonHandler, ProcessJsonRestore, ProcessJsonSave
from orbax_mtc.replicator_manager import ReplicatorCheckpointManager
from orbax_mtc.save.backup import BackupInfo, BackupIntervalPolicy
from orbax_mtc.save.ondemand import OnDemandSave

__version__ = "0.1.0"

__all__ = [
    "AbstractStateMismatchError",
    "AgreementTimeoutError",
    "BackupError",
    "BackupInfo",
    "BackupIntervalPolicy",
    "CheckpointManager",
    "CheckpointError",
    "CheckpointManagerOptions",
    "CorruptStepError",
    "LocalCheckpointOptions",
    "LocalDirectoryInUseError",
    "LocalDirectoryTakenOverError",
    "LocalTierError",
    "ManifestError",
    "ManagedOptions",
    "MissingItemError",
    "MultiprocessingOptions",
    "OnDemandSave",
    "PersistentCheckpointOptions",
    "ProcessJsonHandler",
    "ProcessJsonRestore",
    "ProcessJsonSave",
    "ReplicationOptions",
    "ReplicatorCheckpointManager",
    "ReplicatorCheckpointManagerOptions",
    "ReplicatorError",
    "RestoreInfo",
    "distributed",
    "initialize_multi_tier_checkpointing",
]
