"""Builds the manager's composed parts, each given what it needs (no part reaches back).

The parts, and what depends on what::

  LocalTier, PeerStore  <- the RAM folder (claimed on every process: local/claim.py)
  RamWriter             <- LocalTier; its errors wait in an UnreportedError for the ledger
  StepLedger            <- the all-reduce; own steps (LocalTier), copies (PeerStore),
                           persistent steps (PersistentTier), twin groups (PeerCopies)
  PeerCopies            <- LocalTier, PeerStore, RamWriter, the all-reduce
  BackupScheduler       <- PersistentTier, RamWriter, LocalTier
  RamSaver              <- all of the above
  RamRestore            <- LocalTier, PeerStore, RamWriter, StepLedger, PeerCopies
  OnDemandSaver         <- RamSaver, PeerCopies, BackupScheduler, PersistentTier, StepLedger
  SaveSchedule          <- RamRetention's save times, PersistentTier's policy; it decides
                           from an AgreedState the form reads from the ledger and writer
  TieredRestore         <- RamRestore, PersistentTier, LocalTier, PeerStore, StepLedger
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN

from orbax_mtc import collectives, item_args, reduction, summary
from orbax_mtc.ledger import StepLedger, UnreportedError
from orbax_mtc.local import claim
from orbax_mtc.local import lock as local_lock
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.options import CheckpointManagerOptions
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.restore.executor import RamRestore
from orbax_mtc.restore.tiers import TieredRestore
from orbax_mtc.save import backup
from orbax_mtc.save import policy as save_policy
from orbax_mtc.save.backup_scheduler import BackupScheduler
from orbax_mtc.save.ondemand import OnDemandSaver
from orbax_mtc.save.ram import RamSaver
from orbax_mtc.save.retention import RamRetention


@dataclasses.dataclass
class Parts:
  """The composed parts of one manager."""

  local: local_store.LocalTier
  store: peer_store.PeerStore
  lock: local_lock.LocalDirectoryLock | None
  links: lkg.LinkKeeper
  writer: RamWriter
  ledger: StepLedger
  peers: PeerCopies
  backups: BackupScheduler
  ram: RamSaver
  restorer: RamRestore
  ondemand: OnDemandSaver
  schedule: save_policy.SaveSchedule
  tiers: TieredRestore
  delete_local: Callable[[list[int]], None]  # removes RAM steps, re-points the LKG link


def build(*, options: CheckpointManagerOptions, local_directory: Path,
          abstract_state: Any, process_index: int, process_count: int, worker_index: int,
          persistent: PersistentTier, backup_policy: backup.BackupIntervalPolicy | None,
          peers_optional: bool) -> Parts:
  """Opens the RAM tier on `local_directory` (collective: claimed on every process) and
  builds every part around it.

  Args:
    options: the manager's options.
    local_directory: this process's RAM folder.
    abstract_state: the manager's abstract state (twin groups for listing steps), or None.
    process_index: this process.
    process_count: processes in the job.
    worker_index: this process's index inside its host.
    persistent: the persistent tier.
    backup_policy: back up by minutes, or None.
    peers_optional: a mesh without replicas means no peer copies (instead of an error).

  Raises:
    LocalDirectoryInUseError, ValueError, OSError, CheckpointError: the RAM folder cannot be
      claimed on this or another process (local/claim.py).
  """
  managed = options.mode == "managed"

  # Set once a manager made later in this process takes the RAM folder over: from then on
  # this manager only lists and reloads (the listing agreement); it neither writes into the
  # folder nor saves, restores or deletes.
  taken_over: list[Exception] = []

  def listing_allreduce(parts: reduction.Parts, what: str) -> reduction.Parts:
    return collectives.allreduce(parts, what, process_count, options.agreement_timeout_seconds)

  def allreduce(parts: reduction.Parts, what: str) -> reduction.Parts:
    if taken_over:
      raise taken_over[0]
    return listing_allreduce(parts, what)

  def retire() -> None:
    taken_over.append(local_lock.LocalDirectoryTakenOverError(local_directory))
    writer.retire(taken_over[0])

  summarize = summarize_with(process_index, process_count, allreduce)
  links = lkg.LinkKeeper(local_directory, options.job_name, process_index, worker_index,
                         managed=managed)
  modes = {"dir_mode": options.local.directory_mode, "file_mode": options.local.file_mode}
  # One retention for the step lists, the folders and the copies (an Orbax preservation
  # policy asked with each step's save time and metrics, recorded by the RAM saver).
  policy = options.local.preservation_policy
  retention = RamRetention(options.local.max_to_keep,
                           None if isinstance(policy, LatestN) else policy)
  local = local_store.LocalTier(local_directory, max_to_keep=options.local.max_to_keep,
                               on_commit=lambda step: links.committed(step), keep=retention.kept,
                               reuse_files=not managed, process_index=process_index,
                               process_count=process_count,
                               nice_increment=options.local.background_nice, **modes)
  store = peer_store.PeerStore(local_directory, max_to_keep=options.local.max_to_keep,
                               keep=retention.kept, **modes)

  def prepare_folder() -> None:
    """Clears what a killed process left in the claimed folder."""
    local.prepare()
    store.prepare()
    if not managed:  # the replicator owns the links in managed mode
      lkg.cleanup_temporary(local_directory, options.job_name, process_index, worker_index)

  lock = claim.claim_local_directory(
      local_directory, job_name=options.job_name, process_index=process_index,
      prepare=prepare_folder, summarize=summarize, on_takeover=retire)
  try:
    asynchronous = options.enable_async_checkpointing
    # The writer's errors wait for the next agreement, which the ledger makes.
    unreported = UnreportedError()
    writer = RamWriter(local, process_index, process_count, asynchronous=asynchronous,
                       on_error=unreported.offer, nice_increment=options.local.background_nice)
    peers = PeerCopies(options, process_index, process_count, local=local, store=store,
                       writer=writer,
                       allreduce=lambda parts: allreduce(parts, "the peer copies of a step"),
                       send=not managed, optional=peers_optional)
    backups = BackupScheduler(
        persistent, writer, local, policy=backup_policy,
        timeout_secs=(options.async_options or ocp.AsyncOptions()).timeout_secs,
        skip_when_busy=options.persistent.skip_backups_when_busy)
    ledger = StepLedger(
        process_count=process_count,
        own_steps=lambda: local.saved_counts.of_this_count(local.steps()),
        copies=lambda own: store.servable(own) if peers.enabled else [],
        persistent_steps=persistent.steps,
        listing_groups=lambda: peers.listing_groups(abstract_state, item_args.is_array_target),
        keep=retention.kept, unreported=unreported,
        before_local_raise=lambda: backups.poll(block=True), process_index=process_index,
        allreduce=allreduce, listing_allreduce=listing_allreduce)
    ram = RamSaver(local=local, writer=writer, ledger=ledger, backups=backups, peers=peers,
                   persistent=persistent, retention=retention, asynchronous=asynchronous,
                   device_copy=options.local.device_copy)
    chunks = dict(chunk_bytes=options.replication.chunk_bytes,
                  window=options.replication.chunks_in_flight)
    restorer = RamRestore(me=process_index, count=process_count, local=local, store=store,
                          writer=writer, ledger=ledger, peers=peers, **chunks)
    ondemand = OnDemandSaver(
        grace_seconds=options.ondemand_grace_seconds, read_only=options.local.read_only,
        managed=managed, local=local, writer=writer, ram=ram, peers=peers, backups=backups,
        persistent=persistent, ledger=ledger)
    schedule = save_policy.SaveSchedule(
        options, managed=managed, saved_at=retention.saved_at,
        backup_by_minutes=backup_policy is not None, persistent_policy=persistent.policy_says)

  except BaseException:
    if lock is not None:
      lock.release()  # nothing stays claimed by a manager that was never built
    raise

  def delete_local(steps: list[int]) -> None:
    """Removes RAM steps (main thread, no write in flight) and re-points the LKG link."""
    if taken_over:
      raise taken_over[0]
    for step in steps:
      local.delete(step)
    if steps:
      links.refresh(local.steps())

  tiers = TieredRestore(ram=restorer, persistent=persistent, local=local, store=store,
                        writer=writer, ledger=ledger, delete_local=delete_local,
                        summarize=summarize)
  return Parts(local=local, store=store, lock=lock, links=links, writer=writer, ledger=ledger,
               peers=peers, backups=backups, ram=ram, restorer=restorer, ondemand=ondemand,
               schedule=schedule, tiers=tiers, delete_local=delete_local)


def summarize_with(process_index: int, process_count: int,
                   allreduce: Callable[[reduction.Parts, str], reduction.Parts]
                   ) -> Callable[[Any, str], summary.Summary]:
  """`summarize(record, what)`: who reports what in every process's record, over
  `allreduce` (summary.py)."""
  def summarize(record: Any, what: str) -> summary.Summary:
    return summary.summarize(record, process_index, process_count,
                             lambda rnd: allreduce(rnd.parts(), what))
  return summarize
