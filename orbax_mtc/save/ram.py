"""One save to the RAM tier: the save's agreement, then stage, write, back up, copy.

The path of a step: `CheckpointManager.save` -> `save_policy.decide_save` -> `RamSaver.save`
(one agreement of a `SaveRecord` by reductions, save_census: every branch below reads only
agreed figures) ->
`local_staging.stage` (device to host: the blocking part) -> `RamWriter.write` (the writer
thread writes and commits `<local>/<step>/`) -> `BackupScheduler.schedule` (read back for the
persistent tier, when due) -> `PeerCopies.schedule` (copies go out during the next saves).
"""

from __future__ import annotations

import time
from typing import Any

import orbax.checkpoint as ocp

from orbax_mtc import agreement, item_args
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import aside
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.peers import spread
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.save.backup_scheduler import BackupScheduler
from orbax_mtc.save.retention import RamRetention


class RamSaver:
  """Saves steps to this node's RAM tier, the same way on every process.

  Args:
    local: this node's RAM tier.
    writer: its writer thread.
    ledger: the agreed step lists and faults.
    backups: the persistent backup scheduler.
    peers: the peer copies.
    persistent: the persistent tier.
    retention: the RAM tier's retention (records each step's save time and metrics).
    asynchronous: writes run in the background (else `save` returns with every tier done).
    device_copy: stage accelerator shards as device-side copies
      (`LocalCheckpointOptions.device_copy`).
  """

  def __init__(self, *, local: local_store.LocalTier, writer: RamWriter, ledger: StepLedger,
               backups: BackupScheduler, peers: PeerCopies, persistent: PersistentTier,
               retention: RamRetention, asynchronous: bool, device_copy: bool = False):
    self._local = local
    self._writer = writer
    self._ledger = ledger
    self._backups = backups
    self._peers = peers
    self._persistent = persistent
    self._asynchronous = asynchronous
    self._device_copy = device_copy
    self._retention = retention
    self.last_blocking_seconds: float | None = None

  def save(self, step: int, args: Any, *, backup_wanted: bool = False, metrics: Any = None,
           custom_metadata: dict[str, Any] | None = None, parent_saved: bool = False,
           ondemand: bool = False) -> None:
    """Stages and writes `step` to RAM (and schedules its backup and peer copies).

    Collective: every process calls it for the same step.

    Args:
      step: the step.
      args: Orbax save args.
      backup_wanted: the step is due for a persistent backup.
      metrics: Orbax metrics (for the backup).
      custom_metadata: Orbax custom metadata (for the backup).
      parent_saved: Orbax's own save has just written the step to the persistent tier (the
        parent-style form, which mirrors it into RAM).
      ondemand: the preemption save, which skips a step every node holds already.

    Raises:
      ValueError: processes save different steps.
      ocp.checkpoint_manager.StepAlreadyExistsError: the step is in a tier already.
      agreement.CheckpointError: an earlier local write failed on some process, or a
        per-process item could not be encoded there.
    """
    # A per-process value this process cannot encode is its own error: it goes to every
    # process through this save's agreement (rule 9), not raised here alone.
    trees, jsons, processes, default_item = item_args.split_save_args(
        args, on_process_error=self._ledger.note_local_error)
    self._writer.wait()  # one write in flight (as Orbax): steps commit in order
    self._backups.wait_for_read()
    # Until the step's write is issued, the work this save hands the writer thread (the
    # landed chunks of a peer's copy, their commit) queues behind that write.
    with self._writer.first():
      # The copies issued at the previous calls have had a training step to arrive: their last
      # chunks go to the writer, and whether they failed here rides in the agreement.
      copies_failed = self._peers.retire_landing()
      # The save's one agreement (main thread, rule 2). It carries every per-process fact the
      # branches below read, so that every process takes the same ones (rule 8), and any error
      # a process holds, so that every process raises it together (rule 9).
      ledger = self._ledger
      own = self._local.steps()
      persistent = self._persistent.steps()
      record = agreement.SaveRecord(
          step=step, fault=ledger.take_fault(), inventory=ledger.inventory(own, persistent),
          has_step_in_ram=step in own, has_step_persistent=step in persistent,
          wants_backup=backup_wanted, backup_state=self._backups.pending_state(),
          orbax_busy=self._persistent.busy(), clock_ms=int(time.time() * 1000),
          copies_failed=bool(copies_failed), copies_ready_call=self._peers.ready_call,
          copies_wait_ms=self._peers.take_wait_ms())
      what = f"the save of step {step}"
      answer = ledger.agree_save(record, what)
      # Their outcome, agreed by it: committed or dropped on every node after the census, so
      # that the census counts what the writer thread committed before, the same on every
      # node (one round), not the commits and retirements this queues. They keep the floor
      # this census agreed (the newest step every node holds), not the previous one: a copy
      # of a step no node holds any longer would make the next census take a coverage round.
      # Copies not yet issued go out at the end of this save, after its collectives (their
      # step stays in RAM meanwhile: it is the floor every node holds).
      if ledger.process_count > 1:
        self._local.keep_floor = answer.floor
      self._peers.settle(None if copies_failed is None else answer.census.copies_failed)
      self._peers.adapt(answer.census.copies_wait_ms, answer.census.clock_ms)
      if answer.steps_error is not None:
        raise ValueError(answer.steps_error)
      census = answer.census
      floor = answer.floor
      ledger.adopt_answer(answer)
      ledger.raise_answer_faults(answer, f"{what} (or an earlier local write)")
      everywhere = census.in_ram.count == ledger.process_count
      in_ram, in_persistent = census.in_ram, census.in_persistent > 0
      backup_wanted = census.wants_backup
      clock_s = census.clock_ms / 1000  # process 0's clock: backups by minutes count from it
      # Here, on the agreed figures alone, so that every process starts it or none does.
      backup_started = self._backups.advance(census.failed, census.busy, census.all_ready)
      if ondemand and everywhere:
        return  # the preemption step is committed everywhere already
      if not parent_saved and not ondemand and everywhere and backup_wanted and \
          not in_persistent:
        # Committed in RAM everywhere, not yet persistent (e.g. the final step, forced): back
        # up those RAM copies; `args` only describe them. No write follows: the held work
        # goes now (a synchronous flush waits for the read-back queued behind it).
        self._writer.executor.release()
        self._backups.schedule(step, args, trees, jsons, metrics, custom_metadata, clock_s,
                               ledger.summarize)
        if not self._asynchronous:
          self._backups.flush(ledger.summarize)
        return
      if not parent_saved and not ondemand and (in_ram or in_persistent):
        # As Orbax: a step is never silently replaced (the tiers would then disagree on it).
        where = "" if everywhere or not in_ram else f" of process(es) {in_ram} only"
        raise ocp.checkpoint_manager.StepAlreadyExistsError(
            f"Step {step} already exists (RAM tier {self._local.directory}{where} or persistent "
            f"tier {self._persistent.directory}). Delete it first with mgr.delete({step}) on "
            "every process to save it again.")
      # Staged before the step is listed anywhere: a state that cannot be staged (the same on
      # every process) leaves the lists and folders as they were.
      started = time.perf_counter()
      staged = local_staging.stage(step, trees, jsons, default_item=default_item,
                                   process_items=processes, device_copy=self._device_copy)
      self.last_blocking_seconds = time.perf_counter() - started
      if ledger.process_count > 1:
        # Steps kept only as the previous floor (keep_floor is this census's, set above) can
        # go now, before this write reuses their file: the RAM footprint stays at max_to_keep
        # committed steps plus the one being written. So can such copies of the peers' steps,
        # before this step's copies arrive.
        self._local.apply_retention()
        self._peers.apply_retention()
      # Before retention asks for them (a preservation policy reads both).
      self._retention.record(step, clock_s, metrics)
      ledger.adopt_answer(answer, saved=step, floor=floor)
      self._retention.forget_others({step, *own, *ledger.ram})
      # Not whether this process still writes a backup: each process learns that on its own,
      # so it can differ between processes, and this answer decides whether the step is
      # backed up.
      saving_anywhere = bool(census.busy) or backup_started
      now = clock_s
      if not backup_wanted:
        backup_wanted = self._backups.interval_due(step, now, saving_anywhere)
      # The on-demand step in some folders only (an earlier save of it failed elsewhere) is
      # written again everywhere, from the same state; a folder of it here is set aside at
      # the commit instant, not deleted first (rule 10). A parent that saved the step does
      # not list it, so a folder of it here is a leftover of a timeline the job left (a
      # restore the parent served drops none): set aside as never to be read again, or the
      # commit would fail at every restart.
      replace = None
      if step in own:
        replace = aside.REPLACED if ondemand else aside.DAMAGED if parent_saved else None
      if not ondemand:
        # So is a copy of the step held here (this step's own copies go out after its
        # commit): kept until they land, a restore of the step that needs a lost node's
        # shards took them from the old timeline beside the other nodes' new ones.
        self._peers.drop_step(step)
      self._writer.write(staged, replace=replace)
    if backup_wanted:
      self._backups.schedule(step, args, trees, jsons, metrics, custom_metadata, now,
                             ledger.summarize)
      if not self._asynchronous:
        self._backups.flush(ledger.summarize)  # synchronous: both tiers hold the step on return
    if self._peers.carries_on and not ondemand:
      # The link lags: the previous step's copies go on over the next interval and this
      # step sends none, rather than this save waiting for them (the same on every process).
      self._peers.carry(step, trees)
    else:
      self._peers.issue()  # the previous step's copies, left moving while training goes on
      # Its copies start about the call by which every node's previous write was done.
      start = spread.start_call(census.copies_ready_call, self._peers.calls_since_schedule)
      self._peers.schedule(step, trees, start_call=start)
    if not self._asynchronous and not ondemand:  # on demand: raised after the backup
      self._peers.progress(block=True)
      # Synchronous mode: the write is done, and its outcome is raised on every process alike.
      ledger.agree_steps(f"the save of step {step}")
