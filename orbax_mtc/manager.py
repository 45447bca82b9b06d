"""`orbax_mtc.CheckpointManager`: Orbax's `CheckpointManager` API over a RAM tier and a persistent tier.

The class is an `ocp.CheckpointManager` (code that checks `isinstance` keeps working) but does
not run the parent's code: it composes one of three forms, chosen once from the constructor's
arguments (forms/arguments.py), and each method of Orbax's API calls it:

- multi-tier (forms/multi_tier.py): `CheckpointManager(local_directory, persistent_directory,
  global_mesh, abstract_state, options=orbax_mtc.CheckpointManagerOptions(...))`;
- parent-style with a RAM tier (forms/parent_style.py): Orbax's signature plus
  `local_directory=`;
- parent-style alone (forms/orbax_only.py): exactly Orbax's manager on `directory`.

Each form owns a plain Orbax manager on the persistent directory (persistent/tier.py).

Choices where Orbax's meaning needs one for two tiers (multi-tier form; also in docs/api.md):
- `save` returns True when either tier saved; `should_save` is True when either tier would.
- `all_steps`/`latest_step` cover both tiers as agreed by every process (the RAM steps the
  cluster can assemble plus the persistent steps every process sees); they issue no
  collective.
- `restore(None)` takes the newest step every process holds in RAM, else the newest
  persistent step; `restore(step)` takes that step from RAM if every process has it.
- `best_step`/`metrics` rank persistent steps (where Orbax keeps metrics).
- `delete(step)` removes the step from both tiers; `directory` is the persistent directory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

from orbax_mtc.forms import arguments
from orbax_mtc.forms.multi_tier import MultiTierForm, open_multi_tier
from orbax_mtc.forms.orbax_only import OrbaxOnlyForm
from orbax_mtc.forms.parent_style import open_parent_style
from orbax_mtc.options import CheckpointManagerOptions, LocalCheckpointOptions, ReplicationOptions
from orbax_mtc.restore.tiers import RestoreInfo
from orbax_mtc.save.backup import BackupInfo, BackupWaits
from orbax_mtc.save.ondemand import OnDemandSave
from orbax_mtc.topology import Topology

__all__ = ["CheckpointManager", "OnDemandSave", "RestoreInfo"]


class CheckpointManager(ocp.CheckpointManager):
  """Multi-tier checkpointing: RAM disk every few steps, persistent Orbax checkpoint rarely.

  Usage::

    mgr = orbax_mtc.CheckpointManager(
        local_directory="/dev/shm/ckpt", persistent_directory="gs://bucket/run",
        global_mesh=mesh, abstract_state=abstract_state, options=options)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    restored = mgr.restore(None).state

  Or `ocp.CheckpointManager`'s own signature, optionally with `local_directory=` for a RAM
  tier in front (`__init__` shows both forms' parameters).
  """

  # The two forms (docs/api.md), for type checkers and IDEs; `forms/arguments.py` binds a call
  # to the same signatures (tests/test_manager_edges.py keeps them the same).

  @overload
  def __init__(
      self,
      local_directory: epath.PathLike,
      persistent_directory: epath.PathLike,
      global_mesh: jax.sharding.Mesh,
      abstract_state: Any,
      *,
      options: CheckpointManagerOptions | emergency.CheckpointManagerOptions | None = None,
      metadata: Mapping[str, Any] | None = None,
      logger: ocp.logging.AbstractLogger | None = None,
      item_handlers: ocp.CheckpointHandler | Mapping[str, ocp.CheckpointHandler] | None = None,
      handler_registry: ocp.handlers.CheckpointHandlerRegistry | None = None,
      persistent_non_replicated_directory: epath.PathLike | None = None,
  ) -> None: ...

  @overload
  def __init__(
      self,
      directory: epath.PathLike,
      checkpointers: ocp.AbstractCheckpointer | Mapping[str, ocp.AbstractCheckpointer] | None
      = None,
      options: ocp.CheckpointManagerOptions | None = None,
      metadata: Mapping[str, Any] | None = None,
      item_names: Sequence[str] | None = None,
      item_handlers: ocp.CheckpointHandler | Mapping[str, ocp.CheckpointHandler] | None = None,
      logger: ocp.logging.AbstractLogger | None = None,
      handler_registry: ocp.handlers.CheckpointHandlerRegistry | None = None,
      *,
      local_directory: epath.PathLike | None = None,
      global_mesh: jax.sharding.Mesh | None = None,
      abstract_state: Any = None,
      local_options: LocalCheckpointOptions | None = None,
      replication_options: ReplicationOptions | None = None,
      job_name: str | None = None,
  ) -> None: ...

  def __init__(self, *args: Any, **kwargs: Any) -> None:  # pylint: disable=super-init-not-called
    # Not the parent's __init__: the form owns the Orbax manager that runs Orbax's code.
    form, params = arguments.bind(args, kwargs, CheckpointManagerOptions)
    self._form: MultiTierForm | OrbaxOnlyForm = (
        open_multi_tier(**params) if form == arguments.MULTI_TIER
        else open_parent_style(**params))

  __init__.__doc__ = f"""Two ways in (docs/api.md), told apart by the arguments.

    Multi-tier, Orbax's emergency `CheckpointManager` signature (`options` may be Orbax's own
    emergency `CheckpointManagerOptions`, converted field for field;
    `persistent_non_replicated_directory` keeps Orbax's meaning: the `dataset` item of each
    save goes to a plain Orbax manager there)::

      CheckpointManager{arguments.describe(arguments.MULTI_TIER_SIGNATURE, " " * 6)}

    Parent-style, `ocp.CheckpointManager`'s signature with `ocp.CheckpointManagerOptions`: it
    behaves exactly as Orbax's manager on `directory`. `local_directory=` adds a RAM tier in
    front (the mesh and targets then come from the save and restore args when `global_mesh`
    and `abstract_state` are not given)::

      CheckpointManager{arguments.describe(arguments.PARENT_STYLE_SIGNATURE, " " * 6)}

    Raises:
      TypeError: a call that fits neither form (the message shows both), options or mesh of
        the wrong kind.
      ValueError: missing or identical directories, a mesh that does not fit the options.
      LocalDirectoryInUseError: another live process holds the RAM folder.
    """

  def __getattr__(self, name: str) -> Any:
    # Orbax's private state (`_checkpointer`, `_checkpoints`, ...) lives in the Orbax manager
    # the form owns; code written against Orbax's manager (its own tests) reads it there.
    form = self.__dict__.get("_form")
    if form is None or not name.startswith("_") or name.startswith("__"):
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return getattr(form.persistent.orbax, name)

  # ------------------------------------------------------------------ public state

  @property
  def directory(self) -> epath.Path:
    """The persistent directory (Orbax's `directory`)."""
    return self._form.directory

  @property
  def options(self) -> CheckpointManagerOptions | ocp.CheckpointManagerOptions:
    """The options the manager was built with (Orbax's, for the parent-style form)."""
    return self._form.user_options

  @property
  def local_directory(self) -> Path | None:
    """This node's RAM-tier folder (None for a parent-style manager without one)."""
    return self._form.local_directory

  @property
  def global_mesh(self) -> jax.sharding.Mesh | None:
    """The job's global mesh."""
    return self._form.global_mesh

  @property
  def replica_axis(self) -> str | None:
    """The mesh axis that indexes replicas."""
    return self._form.replica_axis

  @property
  def topology(self) -> Topology | None:
    """Replicas, twins and peers of this job (None in a single process)."""
    return self._form.topology

  @property
  def in_primary_slice(self) -> bool:
    """As Orbax's emergency manager: this process is in the first replica."""
    return self._form.in_primary_slice

  @property
  def last_restore(self) -> RestoreInfo | None:
    """Where the last `restore` came from."""
    return self._form.last_restore

  @last_restore.setter
  def last_restore(self, value: RestoreInfo | None) -> None:
    self._form.last_restore = value

  @property
  def last_ondemand(self) -> OnDemandSave | None:
    """The newest on-demand save, and its times."""
    return self._form.last_ondemand

  @property
  def last_save_blocking_seconds(self) -> float | None:
    """How long the newest RAM save blocked the caller."""
    return self._form.last_save_blocking_seconds

  @property
  def last_replication_bytes(self) -> int:
    """Bytes this process sent for the newest replicated step."""
    return self._form.last_replication_bytes

  @property
  def last_backup(self) -> BackupInfo | None:
    """The newest persistent backup attempt (`BackupInfo`)."""
    return self._form.last_backup

  @property
  def pending_backup(self) -> int | None:
    """The step chosen for backup and not yet handed to Orbax (its read-back from RAM, or an
    earlier backup still being written, holds it)."""
    return self._form.pending_backup

  @property
  def backup_history(self) -> Sequence[BackupInfo]:
    """Finished backup attempts, newest last (done, failed or skipped), for monitoring."""
    return self._form.backup_history

  @property
  def backup_waits(self) -> BackupWaits | None:
    """Saves that waited for room in the backup queue, and due steps skipped
    (`skip_backups_when_busy`)."""
    return self._form.backup_waits

  # ------------------------------------------------------------------ decisions

  def reached_preemption(self, step: int) -> bool:
    """True at the step every process saves on after any of them got SIGTERM.

    Call it (or `save`) at every step, on every process, in the same order. Asking again
    about a step gives the same answer. The parent-style form keeps Orbax's meaning (JAX's
    sync point).
    """
    return self._form.reached_preemption(step)

  def should_exit(self) -> bool:
    """True once the preemption sync step was reached: save it, then stop training."""
    return self._form.should_exit()

  def should_save(self, step: int) -> bool:
    return self._form.should_save(step)

  # ------------------------------------------------------------------ save

  def save(self, step: int, items: Any = None, save_kwargs: Mapping[str, Any] | None = None,
           metrics: Mapping[str, Any] | None = None, force: bool | None = False,
           args: ocp.args.CheckpointArgs | None = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Saves `step` to the tiers whose schedule (or `force`, or a preemption) asks for it.

    Returns:
      Whether any tier saved the step (the same on every process).

    Raises:
      ValueError: a negative step, different steps on different processes, or an item named
        `process_metadata` (reserved, as in Orbax's emergency manager).
      StepAlreadyExistsError: the step is in a tier already.
      CheckpointError: an earlier RAM write failed on some process.
    """
    return self._form.save(step, items=items, save_kwargs=save_kwargs, metrics=metrics,
                           force=force, args=args, custom_metadata=custom_metadata)

  def wait_until_local_finished(self) -> None:
    """Waits for this process's own RAM write and its part of the backup in flight. No
    collective (peer copies wait for the next save): a process may call it alone. A failure
    is raised by the next save or `wait_until_finished`, on every process alike."""
    self._form.wait_until_local_finished()

  def replicate_pending(self) -> None:
    """Sends the newest local step to its peers now, blocking until the bytes are out. Every
    process calls it at the same point (collectives). `save()` already does this a few chunks
    at a time; call it before a planned stop to protect the last step."""
    self._form.replicate_pending()

  # ------------------------------------------------------------------ restore

  def restore(self, step: int | None = None, items: Any = None,
              restore_kwargs: Mapping[str, Any] | None = None,
              directory: epath.PathLike | None = None,
              args: ocp.args.CheckpointArgs | None = None) -> Any:
    """Restores the newest step the whole cluster can assemble (see module docstring).

    Raises:
      FileNotFoundError: `step` is in neither tier.
      AbstractStateMismatchError: the targets do not match what was saved (nothing is
        deleted).
      LocalTierError: `step` is in RAM everywhere but unusable, and not persistent.
    """
    return self._form.restore(step, items=items, restore_kwargs=restore_kwargs,
                              directory=directory, args=args)

  # ------------------------------------------------------------------ steps and metadata

  def all_steps(self, read: bool = False) -> list[int]:
    return self._form.all_steps(read)

  def latest_step(self) -> int | None:
    return self._form.latest_step()

  def best_step(self) -> int | None:
    return self._form.best_step()

  def metrics(self, step: int) -> Any:
    return self._form.metrics(step)

  def reload(self) -> None:
    """Re-reads both tiers and agrees the step lists again (every process calls it)."""
    self._form.reload()

  def delete(self, step: int) -> None:
    """Deletes `step` from both tiers; a read-only tier keeps it (as Orbax's read-only one)."""
    self._form.delete(step)

  def item_metadata(self, step: int) -> Any:
    return self._form.item_metadata(step)

  def metadata(self, step: int | None = None) -> Any:
    return self._form.metadata(step)

  def is_saving_in_progress(self) -> bool:
    return self._form.is_saving_in_progress()

  # ------------------------------------------------------------------ lifecycle

  def wait_until_finished(self) -> None:
    """Waits for the RAM write, the peer copies and the backup in flight (bounded by Orbax's
    `AsyncOptions.timeout_secs` but for its metadata write). An agreement: every process calls
    it at the same point, as Orbax's multi-host waits.

    Raises:
      CheckpointError: on every process alike, for a failed RAM write on any of them.
      BackupError: else, if the newest backup failed (once; the RAM tier still has the step).
    """
    self._form.wait_until_finished()

  def check_for_errors(self) -> None:
    """Raises `BackupError` for a failed newest backup (once), on this process. A failed RAM
    write is raised by the next save or `wait_until_finished`, on every process alike."""
    self._form.check_for_errors()

  def close(self) -> None:
    self._form.close()
