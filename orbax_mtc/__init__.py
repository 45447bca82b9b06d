"""orbax-mtc: multi-tier checkpointing for JAX, as an Orbax CheckpointManager subclass.

Public API::

  import orbax_mtc as mtc
  mgr = mtc.CheckpointManager(local_directory, persistent_directory, global_mesh,
                              abstract_state, options=mtc.CheckpointManagerOptions(...))
"""

from orbax_mtc import distributed
from orbax_mtc.agreement import CheckpointError
from orbax_mtc.backup import BackupError, BackupInfo, BackupIntervalPolicy
from orbax_mtc.collectives import AgreementTimeoutError
from orbax_mtc.local_lock import LocalDirectoryInUseError
from orbax_mtc.local_tier import (
    AbstractStateMismatchError,
    CorruptStepError,
    LocalTierError,
    ManifestError,
)
from orbax_mtc.managed import initialize_multi_tier_checkpointing
from orbax_mtc.manager import CheckpointManager, OnDemandSave, RestoreInfo
from orbax_mtc.options import (
    CheckpointManagerOptions,
    LocalCheckpointOptions,
    ManagedOptions,
    PersistentCheckpointOptions,
    ReplicationOptions,
)
from orbax_mtc.replicator import ReplicatorError

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
    "LocalTierError",
    "ManifestError",
    "ManagedOptions",
    "OnDemandSave",
    "PersistentCheckpointOptions",
    "ReplicationOptions",
    "ReplicatorError",
    "RestoreInfo",
    "distributed",
    "initialize_multi_tier_checkpointing",
]
