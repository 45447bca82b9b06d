"""`orbax_mtc.CheckpointManager`: an `ocp.CheckpointManager` with a RAM-disk tier in front.

The parent class *is* the persistent tier: it is constructed on `persistent_directory` with the
persistent options, so the persistent tier is a standard Orbax checkpoint written by Orbax's
own code, and every parent API keeps its meaning there. On top of it this class adds the local
tier (this node's RAM-disk folder) and decides, per step, what each tier does.

Choices where the parent's meaning needs one for two tiers (also in docs/api.md):
- `save` returns True when either tier saved; `should_save` is True when either tier would.
- `all_steps`/`latest_step` cover both tiers as agreed by every process (the RAM steps the
  cluster can assemble plus the persistent steps every process sees); they issue no
  collective.
- `restore(None)` takes the newest step every process holds in RAM, else the newest
  persistent step; `restore(step)` takes that step from RAM if every process has it.
- `best_step`/`metrics` rank persistent steps (where Orbax keeps metrics), and fall back to
  the local manifest for steps only in RAM.
- `delete(step)` removes the step from both tiers; `directory` is the persistent directory.

This module holds the Orbax API overrides only; each delegates to a composed part built by
wiring.py (docs/design.md, "Where the code lives", lists them and the path of a step).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from orbax_mtc import (
  backup,
  constructor,
  distributed,
  item_args,
  non_replicated,
  preemption,
  save_policy,
  wiring,
)
from orbax_mtc.local import specs as local_specs
from orbax_mtc.managed import hookup
from orbax_mtc.ondemand import OnDemandSave, ram_step_metadata
from orbax_mtc.options import CheckpointManagerOptions
from orbax_mtc.persistent import PersistentTier, persistent_view_when_nested
from orbax_mtc.restore.tiers import RestoreInfo
from orbax_mtc.wiring import Reported

__all__ = ["CheckpointManager", "OnDemandSave", "RestoreInfo"]


class CheckpointManager(ocp.CheckpointManager):
  """Multi-tier checkpointing: RAM disk every few steps, persistent Orbax checkpoint rarely.

  Usage::

    mgr = orbax_mtc.CheckpointManager(
        local_directory="/dev/shm/ckpt", persistent_directory="gs://bucket/run",
        global_mesh=mesh, abstract_state=abstract_state, options=options)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    restored = mgr.restore(None).state
  """

  _OWNS_SIGTERM = True  # without jax.distributed (the parent-style form keeps Orbax's)
  _non_replicated = non_replicated.NONE  # Orbax's `dataset` item folder (multi-tier form)

  def __new__(cls, *args: Any, **kwargs: Any):
    if cls is CheckpointManager:
      form, _ = constructor.bind(args, kwargs, CheckpointManagerOptions)
      if form == constructor.PARENT_STYLE:
        from orbax_mtc.parent_style import ParentStyleCheckpointManager
        cls = ParentStyleCheckpointManager
    return super().__new__(cls)

  def __init__(self, *args: Any, **kwargs: Any):
    """Two ways in (docs/api.md), told apart by the arguments:

    multi-tier: `CheckpointManager(local_directory, persistent_directory, global_mesh,
    abstract_state, *, options=orbax_mtc.CheckpointManagerOptions(...), metadata=None,
    logger=None, item_handlers=None, handler_registry=None,
    persistent_non_replicated_directory=None)` (the last as in Orbax's emergency manager).

    parent-style: `ocp.CheckpointManager`'s signature (`directory, checkpointers=None,
    options=None, metadata=None, item_names=None, item_handlers=None, logger=None,
    handler_registry=None`) with `ocp.CheckpointManagerOptions`; it behaves exactly as the
    parent on `directory`. Keyword-only `local_directory=` adds a RAM tier in front (with
    `global_mesh`, `abstract_state`, `local_options`, `replication_options`, `job_name`
    optional: the mesh and targets then come from the save and restore args).

    Raises:
      TypeError: options or mesh of the wrong kind.
      ValueError: missing or identical directories, a mesh that does not fit the options.
      LocalDirectoryInUseError: another live process holds the RAM folder.
    """
    self._view = threading.local()
    _, params = constructor.bind(args, kwargs, CheckpointManagerOptions)
    self._init_multi_tier(**params)

  def _init_multi_tier(self, local_directory, persistent_directory, global_mesh, abstract_state,
                       options, metadata, logger, item_handlers, handler_registry,
                       persistent_non_replicated_directory) -> None:
    options = constructor.check_multi_tier(local_directory, persistent_directory, global_mesh,
                                           options, CheckpointManagerOptions)
    minutes = options.persistent.backup_interval_minutes
    self._open(local_directory, persistent_directory, options, abstract_state,
               backup_policy=backup.BackupIntervalPolicy(minutes)
               if minutes is not None and options.mode != "managed" else None,
               peers_optional=False)
    self._peers.set_mesh(global_mesh)
    with self._persistent_view():
      super().__init__(persistent_directory, options=options.persistent_manager_options(),
                       metadata=metadata, logger=logger, item_handlers=item_handlers,
                       handler_registry=handler_registry)
    self._non_replicated = non_replicated.NonReplicatedItems(
        persistent_non_replicated_directory, options.persistent_manager_options(),
        metadata=metadata, item_handlers=item_handlers, handler_registry=handler_registry)
    self._ready()
    if self._managed:
      # The first restore(None) honours the replicator's entry; 0 = it has nothing.
      self._tiers.replicator_entry = hookup.connect(
          self._local.directory, options, self._peers.topology, self._process_index,
          self._process_count, self._worker_index, self._agree)
    # One answer on every process from the start (rule 8): after a node loss the replaced
    # node's own folder is empty, but the cluster can still restore from twins and peers.
    self._ledger.agree_steps("starting the checkpoint manager")
    self._backups.start_clock(self._ledger.persistent, self._agree)  # by minutes: agreed
    self._tiers.list_elastic_steps()  # steps saved on another process count, rebuilt from RAM

  # ------------------------------------------------------------------ construction

  def _open(self, local_directory, persistent_directory, options: CheckpointManagerOptions,
            abstract_state: Any, *, backup_policy: backup.BackupIntervalPolicy | None,
            peers_optional: bool) -> None:
    """Opens the RAM tier (claimed on every process) and builds the composed parts."""
    self._mtc_options = options
    self._abstract_state = abstract_state
    self._process_index = jax.process_index()
    self._process_count = jax.process_count()
    self._worker_index = (options.worker_index if options.worker_index is not None
                          else distributed.worker_index())
    self._managed = options.mode == "managed"
    local_path = Path(str(local_directory))
    if str(local_path) == str(persistent_directory):
      raise ValueError("local_directory and persistent_directory must be different folders.")
    self._persistent = PersistentTier(self, self._parent_method)
    parts = wiring.build(options=options, local_directory=local_path,
                         abstract_state=abstract_state, process_index=self._process_index,
                         process_count=self._process_count, worker_index=self._worker_index,
                         persistent=self._persistent, backup_policy=backup_policy,
                         peers_optional=peers_optional,
                         orbax_says=lambda step: self._orbax_says(step))
    self._local, self._store, self._directory_lock = parts.local, parts.store, parts.lock
    self._writer, self._ledger, self._peers = parts.writer, parts.ledger, parts.peers
    self._backups, self._ram, self._ondemand = parts.backups, parts.ram, parts.ondemand
    self._schedule, self._tiers = parts.schedule, parts.tiers
    self._delete_local = parts.delete_local

  def _ready(self) -> None:
    """After the parent's __init__: the overrides take over from here."""
    # Only the thread that built the manager (the training loop) creates preemption ids.
    self._owner_thread = threading.current_thread()
    self._sync_point = preemption.SyncPoint(self._owner_thread)
    self._own_sigterm_handler = self._OWNS_SIGTERM and preemption.attach(self._process_count)
    self._closed = False
    self._mtc_ready = True
    logging.info("orbax-mtc: process %d/%d, local %s, persistent %s, replica axis %r",
                 self._process_index, self._process_count, self._local.directory,
                 self.directory, self._peers.replica_axis)

  # ------------------------------------------------------------------ plumbing

  @contextlib.contextmanager
  def _persistent_view(self):
    previous = getattr(self._view, "persistent", False)
    self._view.persistent = True
    try:
      yield
    finally:
      self._view.persistent = previous

  def _parent_method(self, name: str) -> Callable[..., Any]:
    """The parent class's method `name`, run in the persistent view."""
    method = getattr(super(), name)

    def call(*args: Any, **kwargs: Any) -> Any:
      with self._persistent_view():
        return method(*args, **kwargs)
    return call

  def _agree(self, record: Any, what: str) -> list[Any]:
    """Every process's record of this call (one all-gather; rule 8)."""
    return self._ledger.agree(record, what)

  # ------------------------------------------------------------------ public state

  local_directory = Reported("_local", "directory",
                             "This node's RAM-tier folder (None for a parent-style manager "
                             "without one).")
  global_mesh = Reported("_peers", "mesh", "The job's global mesh.")
  replica_axis = Reported("_peers", "replica_axis", "The mesh axis that indexes replicas.")
  topology = Reported("_peers", "topology",
                      "Replicas, twins and peers of this job (None in a single process).")
  last_restore = Reported("_tiers", "last", "Where the last `restore` came from.", settable=True)
  last_ondemand = Reported("_ondemand", "last", "The newest on-demand save, and its times.")
  last_save_blocking_seconds = Reported("_ram", "last_blocking_seconds",
                                        "How long the newest RAM save blocked the caller.")
  last_backup = Reported("_backups", "last_backup", "The newest persistent backup attempt.")
  pending_backup = Reported(
      "_backups", "pending_step", "The step chosen for backup and not yet handed to Orbax "
      "(its read-back from RAM, or an earlier backup still being written, holds it).")
  backup_history = Reported("_backups", "history", "Finished backup attempts, newest last "
                            "(done, failed or skipped), for monitoring.", default=())
  backup_waits = Reported("_backups", "waits", "Saves that waited for room in the backup "
                          "queue, and due steps skipped (`skip_backups_when_busy`).")
  in_primary_slice = Reported("_peers", "in_primary_slice", "As Orbax's emergency manager: "
                              "this process is in the first replica.", default=True)
  last_replication_bytes = Reported("_peers", "last_bytes_sent", "Bytes this process sent "
                                    "for the newest replicated step.", default=0)

  @property
  def options(self) -> CheckpointManagerOptions | ocp.CheckpointManagerOptions:
    """The options the manager was built with."""
    return self._mtc_options

  # ------------------------------------------------------------------ decisions

  def _orbax_says(self, step: int) -> bool:
    """Orbax's own policy for the persistent tier, asked with the agreed persistent steps."""
    return self._persistent.policy_says(step, self._ledger.persistent,
                                        lambda: self.reached_preemption(step),
                                        saving=lambda: self._backups.saving)

  @persistent_view_when_nested
  def should_save(self, step: int) -> bool:
    if self.reached_preemption(step):
      return True
    return self._schedule.ram_due(step) or self._schedule.persistent_due(step)

  def reached_preemption(self, step: int) -> bool:
    """True at the step every process saves on after any of them got SIGTERM.

    Call it (or `save`) at every step, on every process, in the same order. Asking again
    about a step gives the same answer. Not wrapped for the parent: its internal calls (from
    `save`, `should_save` and its finalize thread) must see this answer, never ask JAX with
    the user's step.
    """
    if not self.__dict__.get("_mtc_ready"):
      return False
    return self._sync_point.reached(step)

  def should_exit(self) -> bool:
    """True once the preemption sync step was reached: save it, then stop training."""
    sync_point = self.__dict__.get("_sync_point")
    return sync_point is not None and sync_point.step is not None

  # ------------------------------------------------------------------ save

  @persistent_view_when_nested
  def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
           force: bool | None = False, args: Any = None,
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
    args = item_args.save_args_of(items, args)
    step = save_policy.checked_step(step)
    args = self._non_replicated.save(step, args, force=bool(force), custom_metadata=custom_metadata)
    # An error of an earlier write is not raised here, on this process alone: it travels in
    # the next agreement, so every process raises it together (rule 9).
    self._backups.poll()
    self._peers.progress(block=False)
    last_ondemand = self._ondemand.last
    decision = self._schedule.decide(
        step, force=bool(force), preempted=self.reached_preemption(step),
        ondemand_step=last_ondemand.step if last_ondemand is not None else None)
    action = decision.action
    if action is save_policy.SaveAction.SKIP:
      return False
    if action is save_policy.SaveAction.ONDEMAND:
      self._ondemand.save(step, args, metrics, custom_metadata)
      if self._mtc_options.exit_after_ondemand_checkpoint:
        logging.warning("orbax-mtc: exiting after the on-demand checkpoint of step %d "
                        "(exit_after_ondemand_checkpoint).", step)
        self.close()
        raise SystemExit(0)
    elif action is save_policy.SaveAction.OLDER_STEP:
      self._backups.save_older_step(
          step, args, metrics, custom_metadata, newest_ram=max(self._ledger.ram),
          agreed_persistent=self._ledger.persistent, managed=self._managed,
          synchronous=not self._mtc_options.enable_async_checkpointing)
    elif action is save_policy.SaveAction.LOCAL:
      # Whether the step is already in RAM or persistent is decided there, after the save's
      # one all-gather, so that every process takes the same branch.
      self._ram.save(step, args, backup_wanted=decision.backup, metrics=metrics,
                     custom_metadata=custom_metadata)
    else:  # no RAM tier to take it from (read_only): straight from the arrays
      self._backups.start(step, args, metrics, custom_metadata)
    return True

  def wait_until_local_finished(self) -> None:
    """Waits for this process's own RAM write and its part of the backup in flight. No
    collective (peer copies wait for the next save): a process may call it alone. A failure
    is raised by the next save or `wait_until_finished`, on every process alike."""
    self._writer.wait()
    self._backups.poll(block=True)

  @persistent_view_when_nested
  def replicate_pending(self) -> None:
    """Sends the newest local step to its peers now, blocking until the bytes are out. Every
    process calls it at the same point (collectives). `save()` already does this a few chunks
    at a time; call it before a planned stop to protect the last step."""
    self._peers.finish()

  # ------------------------------------------------------------------ restore

  @persistent_view_when_nested
  def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
              directory: epath.PathLike | None = None, args: Any = None) -> Any:
    """Restores the newest step the whole cluster can assemble (see module docstring).

    Raises:
      FileNotFoundError: `step` is in neither tier.
      AbstractStateMismatchError: the targets do not match what was saved (nothing is
        deleted).
      LocalTierError: `step` is in RAM everywhere but unusable, and not persistent.
    """
    args = item_args.restore_args_of(items, args)
    if directory is not None:  # an explicit folder is a plain Orbax restore
      with self._persistent_view():
        return super().restore(step, directory=directory, args=args)
    self._writer.wait()
    self._backups.drop_pending("a restore")
    return self._non_replicated.restore(step, args, self._tiers, self._abstract_state)

  # ------------------------------------------------------------------ steps and metadata

  @persistent_view_when_nested
  def all_steps(self, read: bool = False) -> list[int]:
    # The agreed lists (rule 8): the same on every process, and kept current by the
    # agreements that start-up, each local save, restore, delete, reload and
    # wait_until_finished make anyway; this call issues no collective.
    return sorted(set(self._ledger.ram) | set(self._ledger.persistent))

  @persistent_view_when_nested
  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @persistent_view_when_nested
  def reload(self):
    """Re-reads both tiers and agrees the step lists again (every process calls it)."""
    with self._persistent_view():
      super().reload()
    self._ledger.agree_steps("reload")
    self._tiers.list_elastic_steps()

  @persistent_view_when_nested
  def delete(self, step: int):
    """Deletes `step` from both tiers; a read-only tier keeps it (as Orbax's read-only one)."""
    # Neither the local writer nor Orbax's finalize thread may still be writing the step.
    self._finish_all(f"delete({step})")
    writable = not self._mtc_options.local.read_only
    if writable:
      self._delete_local([step] if step in self._local.steps() else [])
      self._store.delete_step(step)
    if step in self._ledger.persistent_seen:  # agreed: every process enters, or none (rule 8)
      self._persistent.delete(step, self._agree)
    if writable:
      self._ledger.forget(step)

  @persistent_view_when_nested
  def item_metadata(self, step: int) -> Any:
    if step in self._persistent.steps():
      with self._persistent_view():
        return super().item_metadata(step)
    return local_specs.item_metadata(self._local.manifest(step))

  @persistent_view_when_nested
  def metadata(self, step: int | None = None) -> Any:
    with self._persistent_view():
      if step is None or step in self._persistent.steps():
        return super().metadata(step)
    return ram_step_metadata(self._local, step)

  @persistent_view_when_nested
  def is_saving_in_progress(self) -> bool:
    return self._writer.writing or self._backups.pending is not None or self._persistent.busy()

  # ------------------------------------------------------------------ lifecycle

  def _finish_all(self, what: str, *, report_backup: bool = False) -> None:
    """RAM write, peer copies, the pending backup: all done, and the step lists and errors
    agreed (every process calls this; errors are raised on every process alike)."""
    self._writer.wait()
    self._peers.finish()
    self._backups.flush(self._agree)
    self._non_replicated.wait_until_finished()
    self._ledger.agree_steps(what, backup_error=self._backups.take_error if report_backup
                             else None)

  @persistent_view_when_nested
  def wait_until_finished(self):
    """Waits for the RAM write, the peer copies and the backup in flight (bounded by Orbax's
    `AsyncOptions.timeout_secs` but for its metadata write). An agreement: every process calls
    it at the same point, as Orbax's multi-host waits.

    Raises:
      CheckpointError: on every process alike, for a failed RAM write on any of them.
      BackupError: else, if the newest backup failed (once; the RAM tier still has the step).
    """
    self._finish_all("wait_until_finished", report_backup=True)

  @persistent_view_when_nested
  def check_for_errors(self):
    """Raises `BackupError` for a failed newest backup (once), on this process. A failed RAM
    write is raised by the next save or `wait_until_finished`, on every process alike."""
    if threading.current_thread() is not self._owner_thread:  # Orbax's finalize thread asks
      with self._persistent_view():
        return super().check_for_errors()
    self._backups.poll()
    self._non_replicated.check_for_errors()
    error = self._backups.take_error()
    if error is not None:
      raise error

  @persistent_view_when_nested
  def close(self):
    if self._closed:
      return
    self._closed = True
    try:
      if not getattr(self._directory_lock, "taken_over", False):  # else finished at takeover
        self.wait_until_finished()
    finally:
      self._writer.shutdown()
      self._local.close()
      if self._directory_lock is not None:
        self._directory_lock.release()
      if self._own_sigterm_handler:
        preemption.detach()
      self._non_replicated.close()
      with self._persistent_view():
        super().close()

