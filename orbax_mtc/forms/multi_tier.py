"""The multi-tier form: a RAM tier in front of a persistent tier, on orbax-mtc's options.

`open_multi_tier` builds it from `CheckpointManager(local_directory, persistent_directory,
global_mesh, abstract_state, options=orbax_mtc.CheckpointManagerOptions(...))`. The persistent
tier is a plain Orbax manager (persistent/tier.py); the parts around the RAM tier come from
parts.py. `MultiTierForm` decides, per call, what each part does; it is what the Orbax API of
`CheckpointManager` (manager.py) calls.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import jax
from absl import logging
from etils import epath

from orbax_mtc import agreement, distributed, item_args
from orbax_mtc.forms import arguments, parts
from orbax_mtc.local import specs as local_specs
from orbax_mtc.managed import handshake
from orbax_mtc.options import CheckpointManagerOptions
from orbax_mtc.persistent import non_replicated
from orbax_mtc.persistent.tier import AgreedPreemptionManager, PersistentTier
from orbax_mtc.save import backup, preemption
from orbax_mtc.save import policy as save_policy
from orbax_mtc.save.ondemand import ram_step_metadata


def open_multi_tier(local_directory, persistent_directory, global_mesh, abstract_state,
                    options, metadata, logger, item_handlers, handler_registry,
                    persistent_non_replicated_directory) -> MultiTierForm:
  """The multi-tier form (arguments as `CheckpointManager`'s multi-tier signature)."""
  options = arguments.check_multi_tier(local_directory, persistent_directory, global_mesh,
                                       options, CheckpointManagerOptions)
  arguments.check_distinct(local_directory, persistent_directory)
  minutes = options.persistent.backup_interval_minutes
  persistent_options = options.persistent_manager_options()
  form = MultiTierForm(
      local_directory, options, abstract_state,
      orbax=lambda: AgreedPreemptionManager(
          persistent_directory, options=persistent_options, metadata=metadata, logger=logger,
          item_handlers=item_handlers, handler_registry=handler_registry),
      backup_policy=backup.BackupIntervalPolicy(minutes)
      if minutes is not None and options.mode != "managed" else None,
      peers_optional=False, own_sigterm=True, mesh=global_mesh)
  form.non_replicated = non_replicated.NonReplicatedItems(
      persistent_non_replicated_directory, persistent_options, metadata=metadata,
      item_handlers=item_handlers, handler_registry=handler_registry)
  if form.managed:
    # The first restore(None) honours the replicator's entry; 0 = it has nothing.
    form.tiers.replicator_entry = handshake.connect(
        form.local.directory, options, form.peers.topology, form.process_index,
        form.process_count, form.worker_index, form.ledger.summarize)
  form.start()
  return form


class MultiTierForm:
  """The RAM tier, its peers, backups and restores, in front of a persistent tier.

  Args:
    local_directory: this process's RAM folder (claimed on every process: collective).
    options: orbax-mtc options.
    abstract_state: the state's abstract tree (restore targets), or None.
    orbax: builds the Orbax manager on the persistent directory (not `local_directory`:
      forms/arguments.check_distinct).
    backup_policy: back up by minutes, or None.
    peers_optional: a mesh without replicas means no peer copies (instead of an error).
    own_sigterm: this form agrees the preemption step itself (else the Orbax manager's
      JAX sync point answers).
    mesh: the global mesh, when known.
  """

  def __init__(self, local_directory: Any, options: CheckpointManagerOptions,
               abstract_state: Any, *, orbax: Any, backup_policy: Any, peers_optional: bool,
               own_sigterm: bool, mesh: jax.sharding.Mesh | None):
    self.options = options
    self._abstract_state = abstract_state
    self.process_index = jax.process_index()
    self.process_count = jax.process_count()
    self.worker_index = (options.worker_index if options.worker_index is not None
                         else distributed.worker_index())
    self.managed = options.mode == "managed"
    local_path = Path(str(local_directory))
    self.persistent = PersistentTier(orbax())
    try:
      built = parts.build(options=options, local_directory=local_path,
                          abstract_state=abstract_state, process_index=self.process_index,
                          process_count=self.process_count, worker_index=self.worker_index,
                          persistent=self.persistent, backup_policy=backup_policy,
                          peers_optional=peers_optional)
    except BaseException:
      self.persistent.close()
      raise
    self.local, self.store, self._directory_lock = built.local, built.store, built.lock
    self.writer, self.ledger, self.peers = built.writer, built.ledger, built.peers
    self.backups, self.ram, self.ondemand = built.backups, built.ram, built.ondemand
    self.schedule, self.tiers = built.schedule, built.tiers
    # The loop time save() takes, against LocalCheckpointOptions.save_overhead_budget, and
    # the agreed step before which the RAM policy is not asked again.
    self.save_cost = save_policy.SaveCost(options.local.save_overhead_budget)
    self._held_until: int | None = None
    self._delete_local = built.delete_local
    self.non_replicated = non_replicated.NONE
    if mesh is not None:
      try:
        self.peers.set_mesh(mesh)
      except BaseException:
        self._release()  # a mesh that does not fit: nothing stays claimed or open
        raise
    # Only the thread that built the manager (the training loop) creates preemption ids.
    self._owner_thread = threading.current_thread()
    self.sync_point = preemption.SyncPoint(self._owner_thread) if own_sigterm else None
    self._own_sigterm_handler = own_sigterm and preemption.attach(self.process_count)
    self._closed = False

  def start(self) -> None:
    """Agrees the step lists (collective) and starts the backup clock."""
    logging.info("orbax-mtc: process %d/%d, local %s, persistent %s, replica axis %r",
                 self.process_index, self.process_count, self.local.directory,
                 self.directory, self.peers.replica_axis)
    # One answer on every process from the start (rule 8): after a node loss the replaced
    # node's own folder is empty, but the cluster can still restore from twins and peers.
    self.ledger.agree_steps("starting the checkpoint manager")
    self.backups.start_clock(self.ledger.persistent, self.ledger.summarize)  # by minutes: agreed
    self.tiers.list_elastic_steps()  # steps saved on another process count, rebuilt from RAM

  # ------------------------------------------------------------------ state

  @property
  def directory(self) -> epath.Path:
    return self.persistent.directory

  @property
  def user_options(self) -> CheckpointManagerOptions:
    return self.options

  # What the manager reports (docs/api.md), read from the part that knows it.

  @property
  def local_directory(self) -> Path:
    return self.local.directory

  @property
  def global_mesh(self) -> jax.sharding.Mesh | None:
    return self.peers.mesh

  @property
  def replica_axis(self) -> Any:
    return self.peers.replica_axis

  @property
  def topology(self) -> Any:
    return self.peers.topology

  @property
  def in_primary_slice(self) -> bool:
    return self.peers.in_primary_slice

  @property
  def last_replication_bytes(self) -> int:
    return self.peers.last_bytes_sent

  @property
  def last_restore(self) -> Any:
    return self.tiers.last

  @last_restore.setter
  def last_restore(self, value: Any) -> None:
    self.tiers.last = value

  @property
  def last_ondemand(self) -> Any:
    return self.ondemand.last

  @property
  def last_save_blocking_seconds(self) -> float | None:
    return self.ram.last_blocking_seconds

  @property
  def last_backup(self) -> Any:
    return self.backups.last_backup

  @property
  def pending_backup(self) -> int | None:
    return self.backups.pending_step

  @property
  def backup_history(self) -> Any:
    return self.backups.history

  @property
  def backup_waits(self) -> Any:
    return self.backups.waits

  def agreed_state(self, preempted: bool) -> save_policy.AgreedState:
    """What the save schedule decides from, now."""
    attempt = self.backups.last_attempt
    return save_policy.AgreedState(
        ram=self.ledger.ram, persistent=self.ledger.persistent, preempted=preempted,
        # A save is in progress until its copies are out and the writer thread has nothing
        # left (the read-ahead, received copies): a continuous policy then waits instead of a
        # save that would wait for them (it decides on the primary alone).
        write_in_flight=self.writer.busy or self.peers.busy,
        held_until=self._held_until,
        backup_in_progress=self.backups.saving,
        last_backup_attempt=None if attempt is None else attempt[0])

  # ------------------------------------------------------------------ decisions

  def reached_preemption(self, step: int) -> bool:
    """The agreed preemption answer (preemption.py); the Orbax manager is told it."""
    if self.sync_point is None:
      return self.persistent.orbax.reached_preemption(step)
    reached = self.sync_point.reached(step)
    if reached:
      self.persistent.note_preemption(step)
      self.non_replicated.note_preemption(step)
    return reached

  def should_exit(self) -> bool:
    return self.sync_point is not None and self.sync_point.step is not None

  def should_save(self, step: int) -> bool:
    return self.schedule.should_save(step, self.agreed_state(self.reached_preemption(step)))

  # ------------------------------------------------------------------ save

  def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
           force: bool | None = False, args: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    del save_kwargs  # Orbax's legacy per-item kwargs: none of our tiers takes them
    # Managed: a job that trains on without restoring the replicator's entry never goes back
    # to it (a later restore(None) takes the newest step, not the entry's).
    self.tiers.replicator_entry = None
    started = time.monotonic()
    action = None
    try:
      action = self._save(step, items, metrics, force, args, custom_metadata)
      if self.save_cost.budget is not None and action is save_policy.SaveAction.LOCAL:
        self._hold_after(step, self.save_cost.begin(started))
    finally:
      if self.save_cost.budget is not None:
        self.save_cost.add(started, time.monotonic())
    return action is not save_policy.SaveAction.SKIP

  def _hold_after(self, step: int, cycle: tuple[float, float] | None) -> None:
    """Agrees how long the RAM policy waits after this save (`save_overhead_budget`): the
    previous `cycle`'s cost, the most any process spent, over the budget's share of a
    call, the shortest any process saw (one round per RAM save; collective, rule 8)."""
    cost, call = cycle or (0.0, 0.0)
    found = self.ledger.summarize(agreement.SaveCostRecord(
        cost_us=round(cost * 1e6), call_us=round(call * 1e6)), "spacing saves by their cost")
    _, most_cost = found.ranges["cost_us"]
    least_call, _ = found.ranges["call_us"]
    self._held_until = save_policy.held_until(step, most_cost / 1e6, least_call / 1e6,
                                              self.save_cost.budget)

  def _save(self, step: int, items: Any, metrics: Any, force: bool | None, args: Any,
            custom_metadata: dict[str, Any] | None) -> save_policy.SaveAction:
    """One `save()` call; returns what it did."""
    args = item_args.save_args_of(items, args)
    force = bool(force)
    step = save_policy.checked_step(step)
    args = self.non_replicated.save(step, args, force=force, custom_metadata=custom_metadata)
    # An error of an earlier write is not raised here, on this process alone: it travels in
    # the next agreement, so every process raises it together (rule 9).
    self.backups.poll()
    last_ondemand = self.ondemand.last
    decision = self.schedule.decide(
        step, self.agreed_state(self.reached_preemption(step)), force=force,
        ondemand_step=last_ondemand.step if last_ondemand is not None else None)
    action = decision.action
    if action is not save_policy.SaveAction.LOCAL:
      # Pending copies move on (a local save moves them itself, after its own collectives:
      # JAX runs collectives in order, so chunks issued first would hold up its agreement).
      self.peers.progress(block=False)
    if action is save_policy.SaveAction.SKIP:
      return action
    if action is save_policy.SaveAction.ONDEMAND:
      self.ondemand.save(step, args, metrics, custom_metadata)
      if self.options.exit_after_ondemand_checkpoint:
        logging.warning("orbax-mtc: exiting after the on-demand checkpoint of step %d "
                        "(exit_after_ondemand_checkpoint).", step)
        self.close()
        raise SystemExit(0)
    elif action is save_policy.SaveAction.OLDER_STEP:
      self.backups.save_older_step(
          step, args, metrics, custom_metadata, newest_ram=max(self.ledger.ram),
          agreed_persistent=self.ledger.persistent, managed=self.managed,
          synchronous=not self.options.enable_async_checkpointing)
    elif action is save_policy.SaveAction.LOCAL:
      # Whether the step is already in RAM or persistent is decided there, after the save's
      # agreement, so that every process takes the same branch.
      self.ram.save(step, args, backup_wanted=decision.backup, metrics=metrics,
                    custom_metadata=custom_metadata)
    else:  # no RAM tier to take it from (read_only): straight from the arrays
      self.backups.start(step, args, metrics, custom_metadata)
    return action

  def wait_until_local_finished(self) -> None:
    self.writer.wait()
    self.backups.poll(block=True)

  def replicate_pending(self) -> None:
    self.peers.finish()

  # ------------------------------------------------------------------ restore

  def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
              directory: epath.PathLike | None = None, args: Any = None) -> Any:
    del restore_kwargs
    args = item_args.restore_args_of(items, args)
    if directory is not None:  # an explicit folder is a plain Orbax restore
      return self.persistent.restore(step, args, directory)
    self.writer.wait()
    self.backups.drop_pending("a restore")
    return self.non_replicated.restore(step, args, self.tiers, self._abstract_state)

  # ------------------------------------------------------------------ steps and metadata

  def all_steps(self, read: bool = False) -> list[int]:
    # The agreed lists (rule 8): the same on every process, and kept current by the
    # agreements that start-up, each local save, restore, delete, reload and
    # wait_until_finished make anyway; this call issues no collective.
    del read
    return sorted(set(self.ledger.ram) | set(self.ledger.persistent))

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """Orbax's best persistent step with a `best_fn`; else the latest step of either tier."""
    if self.persistent.tracks_best():
      return self.persistent.best_step()
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metrics(self, step: int) -> Any:
    """The metrics Orbax kept with persistent step `step` (None for a step not there)."""
    return self.persistent.metrics(step)

  def reload(self) -> None:
    self.persistent.reload()
    self.ledger.agree_steps("reload")
    self.tiers.list_elastic_steps()

  def delete(self, step: int) -> None:
    # Neither the local writer nor Orbax's finalize thread may still be writing the step.
    self.finish_all(f"delete({step})")
    writable = not self.options.local.read_only
    if writable:
      self._delete_local([step] if step in self.local.steps() else [])
      self.store.delete_step(step)
    if step in self.ledger.persistent_seen:  # agreed: every process enters, or none (rule 8)
      self.persistent.delete(step, self.ledger.summarize)
    if writable:
      self.ledger.forget(step)

  def item_metadata(self, step: int) -> Any:
    if step in self.persistent.steps():
      return self.persistent.item_metadata(step)
    return local_specs.item_metadata(self.local.manifest(step))

  def metadata(self, step: int | None) -> Any:
    if step is None or step in self.persistent.steps():
      return self.persistent.metadata(step)
    return ram_step_metadata(self.local, step)

  def is_saving_in_progress(self) -> bool:
    return self.writer.writing or self.backups.pending is not None or self.persistent.busy()

  # ------------------------------------------------------------------ lifecycle

  def finish_all(self, what: str, *, report_backup: bool = False) -> None:
    """RAM write, peer copies, the pending backup: all done, and the step lists and errors
    agreed (every process calls this; errors are raised on every process alike)."""
    self.writer.wait()
    self.peers.finish()
    self.backups.flush(self.ledger.summarize)
    self.non_replicated.wait_until_finished()
    self.ledger.agree_steps(what, backup_error=self.backups.take_error if report_backup
                            else None)

  def wait_until_finished(self) -> None:
    self.finish_all("wait_until_finished", report_backup=True)

  def check_for_errors(self) -> None:
    self.backups.poll()
    self.non_replicated.check_for_errors()
    error = self.backups.take_error()
    if error is not None:
      raise error

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      if not getattr(self._directory_lock, "taken_over", False):  # else finished at takeover
        self.wait_until_finished()
    finally:
      if self._own_sigterm_handler:
        preemption.detach()
      self.non_replicated.close()
      self._release()

  def _release(self) -> None:
    """Stops the writer, releases the RAM folder and closes the Orbax manager."""
    self.writer.shutdown()
    self.local.close()
    if self._directory_lock is not None:
      self._directory_lock.release()
    self.persistent.close()

