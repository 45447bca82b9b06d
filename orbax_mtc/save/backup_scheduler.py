"""The persistent backup scheduler: which RAM step goes to the persistent tier, and when.

A step chosen for backup is read back from the RAM tier on the writer thread once its local
write commits (`schedule`). At the next save's agreement, once every process has its copy
and no earlier backup is being written anywhere, every process hands the arrays to Orbax's
save together (`advance`): Orbax's save has barriers, so the decision rests on agreed
figures alone. How each attempt ends is learnt without a collective (`poll`) and reported
through the next agreement (`take_error`), so training goes on when storage fails.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement
from orbax_mtc.agreement import Status
from orbax_mtc.local import read as local_read
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.reduction import Who
from orbax_mtc.save import backup
from orbax_mtc.summary import Summary


class BackupScheduler:
  """Backups from the RAM tier to the persistent tier.

  Args:
    persistent: the persistent tier.
    writer: the RAM tier's writer thread (the read-back runs there).
    local: this node's RAM tier.
    policy: back up by minutes (None: by steps, decided per `save`).
    timeout_secs: Orbax's async timeout (a backup waiting longer for an earlier one is
      worth a warning).
    skip_when_busy: skip a due step when the queue is full, instead of waiting for room
      (`PersistentCheckpointOptions.skip_backups_when_busy`).
  """

  def __init__(self, persistent: PersistentTier, writer: RamWriter, local: local_store.LocalTier,
               *, policy: backup.BackupIntervalPolicy | None, timeout_secs: float,
               skip_when_busy: bool = False):
    self._persistent = persistent
    self._writer = writer
    self._local = local
    self.policy = policy
    self._timeout_secs = timeout_secs
    self.last_attempt: tuple[int, float] | None = None  # (step, seconds since epoch)
    self._pending: backup.PendingBackup | None = None  # chosen, not yet handed to Orbax
    # Chosen while `_pending` still waited for Orbax: next in line (rule 12: a due step is
    # not dropped for a newer one; a third one waits for room, or, when skipping is asked
    # for, replaces it).
    self._queued: backup.PendingBackup | None = None
    self._skip_when_busy = skip_when_busy
    self.waits = backup.BackupWaits()
    self._inflight: int | None = None  # handed to Orbax, outcome not yet known
    self._inflight_metrics: Any = None
    self._error: backup.BackupError | None = None  # newest failure, not yet reported
    # Since when a due backup waits for an earlier one still running (monotonic seconds).
    self._waiting_since: float | None = None
    self._warned_waiting = False
    self.last_backup: backup.BackupInfo | None = None
    # Finished backup attempts, newest last ("done" or "failed"), for monitoring.
    self.history: collections.deque[backup.BackupInfo] = collections.deque(maxlen=100)

  @property
  def pending(self) -> backup.PendingBackup | None:
    """The step chosen for backup and not yet handed to Orbax."""
    return self._pending

  @property
  def pending_step(self) -> int | None:
    """The step of `pending`, if any."""
    return None if self._pending is None else self._pending.step

  def start_clock(self, agreed_steps: Sequence[int],
                  summarize: Callable[[Any, str], Summary]) -> None:
    """By minutes: count from the newest agreed persistent step's commit time, the latest any
    process reads (all read the same file; one that cannot reads 0): one value on every
    process, so every process finds the same saves due (rule 8). Collective when backing up
    by minutes."""
    if self.policy is None or not agreed_steps:
      return
    step = agreed_steps[-1]
    try:
      seconds = self._persistent.commit_time(step) or 0.0
    except Exception as e:  # noqa: BLE001 - agreed below; only moves the first backup
      logging.warning("orbax-mtc: no commit time for persistent step %d here (%s: %s).",
                      step, type(e).__name__, e)
      seconds = 0.0
    found = summarize(agreement.ClockRecord(commit_ms=int(seconds * 1000)),
                      "starting the backup clock")
    _, latest = found.ranges["commit_ms"]
    if latest > 0:
      self.last_attempt = (step, latest / 1000)
    else:
      logging.warning("orbax-mtc: no process can read the commit time of persistent step %d; "
                      "the first backup is taken at the first local save.", step)

  def interval_due(self, step: int, now: float, saving_anywhere: bool) -> bool:
    """By minutes: whether `step` is due (`now` and `saving_anywhere` are agreed)."""
    if self.policy is None:
      return False
    return backup.interval_due(self.policy, step, now, self.last_attempt, saving_anywhere)

  # --------------------------------------------------------------------- choosing

  def schedule(self, step: int, args: Any, trees: dict[str, Any], jsons: dict[str, Any],
               metrics: Any, custom_metadata: dict[str, Any] | None, now: float,
               summarize: Callable[[Any, str], Summary]) -> None:
    """Marks `step` for backup: the writer thread reads it back once its write commits
    (after the write, before any later write can reuse its files). A backup still waiting
    for Orbax keeps its place; this one waits behind it. With both places taken, this call
    first waits for the earlier backup and hands the next to Orbax, as Orbax's own save
    waits for the previous one (collective: every process schedules the same steps), or,
    with `skip_when_busy`, skips the one waiting."""
    if self._queued is not None:
      if self._skip_when_busy:
        self._skip(self._queued.step, step)
      else:
        self._make_room(summarize, step)
    templates, single = backup.templates(args)
    targets = backup.host_targets(trees)
    targets.update({name: None for name in jsons})
    targets.update(backup.process_targets(templates))
    pending = backup.PendingBackup(
        step=step, templates=templates, single=single, targets=targets,
        memory_kind=backup.host_memory_kind(trees), metrics=metrics,
        custom_metadata=custom_metadata)
    pending.read = self._writer.submit(self.read_back, pending)
    if self._pending is None:
      self._pending = pending
    else:
      self._queued = pending
    self.last_attempt = (step, now)

  def _make_room(self, summarize: Callable[[Any, str], Summary], newer: int) -> None:
    """Waits for the backup Orbax writes and starts the next one (collective). A write that
    still runs after Orbax's own timeout is a storage write that hangs: waiting on would stop
    training for as long, so the step waiting behind it is skipped instead (the failed
    backup it would have been), and training goes on."""
    started = time.monotonic()
    pending = self._pending
    if pending is not None:
      concurrent.futures.wait([pending.read])
      idle = self._persistent.wait_idle(self._timeout_secs)
      if idle:
        self.poll(block=True)
      found = summarize(
          agreement.ReadBackRecord(state=pending.state() if idle else Status.WRITING),
          f"waiting to back up step {pending.step}")
      # Starts the pending backup, or drops it when a read failed: either way the queued
      # one moves up. A process still writing keeps both in place.
      self._advance_summary(found, found.state("state", Status.WRITING))
    if self._queued is not None:
      stuck = self._queued.step
      self._queued = None
      self._skip(stuck, newer, why=f"the backup before it still runs after Orbax's timeout "
                 f"({self._timeout_secs:.0f} s): a storage write hangs")
    waited = time.monotonic() - started
    self.waits = dataclasses.replace(self.waits, count=self.waits.count + 1,
                                     seconds=self.waits.seconds + waited)
    logging.info("orbax-mtc: a due backup waited %.2f s for the one before it (as Orbax's "
                 "save does); %d such waits, %.1f s in all.", waited, self.waits.count,
                 self.waits.seconds)

  def _skip(self, skipped: int, newer: int,
            why: str = "skip_backups_when_busy, and an earlier backup still runs") -> None:
    """The step waiting behind a running backup gives way to `newer`."""
    self._queued = None
    self.waits = dataclasses.replace(self.waits, skipped=(*self.waits.skipped, skipped))
    self._record(skipped, "skipped")
    logging.warning("orbax-mtc: the backup of step %d is skipped (%s), and step %d is due. "
                    "Persistent steps skipped so far: %s.", skipped, why, newer,
                    list(self.waits.skipped))
    try:
      backup.record_skips(self._local.directory, self.waits.skipped)
    except OSError as e:
      logging.warning("orbax-mtc: cannot record skipped backups for `orbax-mtc status`: %s", e)

  def read_back(self, pending: backup.PendingBackup) -> dict[str, Any]:
    """Reads the step chosen for backup back from RAM, on the writer thread (file I/O only).

    Returns:
      Item name -> host arrays with the shardings the step was saved with (checksums
      verified).

    Raises:
      LocalTierError, OSError: the step cannot be read; the backup is then dropped on every
        process (`advance`).
    """
    step_dir = self._local.directory / str(pending.step)
    manifest = self._local.manifest(pending.step)
    crcs: dict[tuple[int, int], int] = {}
    data = local_read.read_data(step_dir, manifest, crcs)
    return local_read.arrays_from_buffer(data, manifest, pending.targets, str(step_dir),
                                         crcs=crcs, memory_kind=pending.memory_kind)

  def drop_pending(self, reason: str) -> None:
    """Forgets the chosen steps (an on-demand save or a restore supersedes them)."""
    for pending in (self._pending, self._queued):
      if pending is not None:
        logging.info("orbax-mtc: backup of step %d superseded by %s.", pending.step, reason)
    self._pending = self._queued = None

  def _next(self) -> None:
    """The pending backup was started or dropped: the queued one takes its place."""
    self._pending, self._queued = self._queued, None

  @property
  def saving(self) -> bool:
    """A backup is chosen and not yet handed to Orbax, or Orbax still writes one here."""
    return self._pending is not None or self._inflight is not None or self._persistent.busy()

  def pending_state(self) -> Status:
    """NONE, or the pending read-back's READING, READY or FAILED (for the agreement)."""
    return self._pending.state() if self._pending is not None else Status.NONE

  def wait_for_read(self) -> None:
    """Waits for the pending read-back (done by now but for a very short interval)."""
    reads = [p.read for p in (self._pending, self._queued) if p is not None]
    if reads:
      concurrent.futures.wait(reads)

  def advance(self, failed: Who, busy: Who, all_ready: bool) -> bool:
    """Starts the pending backup once every process has read its copy and no earlier backup
    is being written on any.

    Args:
      failed: the processes whose read-back failed (agreed: counted by a reduction).
      busy: the processes where Orbax still writes an earlier backup (agreed).
      all_ready: every process has read the pending backup back (agreed).

    Returns:
      Whether it started the backup (the same answer on every process).
    """
    pending = self._pending
    if pending is None:
      return False
    if failed:
      self._next()
      error = pending.read.exception() if pending.read is not None and pending.read.done() \
          else None
      logging.warning("orbax-mtc: no backup of step %d: its RAM copy could not be read on "
                      "process(es) %s%s; the next scheduled backup takes a newer step.",
                      pending.step, failed, f" ({error})" if error is not None else "")
      return False
    if busy:
      self._note_waiting(pending.step, busy)
      return False
    if not all_ready:
      return False
    self._next()
    values = pending.read.result()
    args = backup.backup_args(pending.templates, pending.single, values)
    self.start(pending.step, args, pending.metrics, pending.custom_metadata)
    return True

  def _advance_summary(self, found: Summary, busy: Who) -> bool:
    """`advance` from a read-back agreement (summarized)."""
    ready = found.state("state", Status.READY)
    return self.advance(found.state("state", Status.FAILED), busy,
                        ready.count == found.processes)

  def _note_waiting(self, step: int, busy: Who) -> None:
    """Warns once when due backups have waited longer than Orbax's timeout for an earlier one
    that still runs: a storage write hangs (Orbax's timeout does not cover its metadata
    write), and no backup starts until it ends."""
    now = time.monotonic()
    if self._waiting_since is None:
      self._waiting_since = now
      return
    waited = now - self._waiting_since
    if waited > self._timeout_secs and not self._warned_waiting:
      self._warned_waiting = True
      logging.warning(
          "orbax-mtc: no backup has started for %.0f s, longer than Orbax's timeout (%d s): an "
          "earlier backup to %s still runs on process(es) %s, so a storage write may hang. "
          "Training goes on and the RAM tier and peers keep the newest steps; the backup of "
          "step %d starts once it ends.", waited, self._timeout_secs,
          self._persistent.directory, busy, step)

  # --------------------------------------------------------------------- writing

  def start(self, step: int, args: Any, metrics: Any,
            custom_metadata: dict[str, Any] | None) -> None:
    """Orbax's save of `step` (in the background); every process calls it together."""
    self._waiting_since, self._warned_waiting = None, False
    self.poll()
    # Errors Orbax still holds of earlier backups: its next save would raise them here, on
    # this process alone, between barriers every process must reach.
    for error in self._persistent.leftover_errors():
      logging.warning("orbax-mtc: an earlier backup to %s ended with %s: %s",
                      self._persistent.directory, type(error).__name__, error)
    self.last_backup = backup.BackupInfo(step=step, state="uploading", started_at=time.time())
    self._inflight, self._inflight_metrics = step, metrics
    try:
      self._persistent.save(step, args, metrics, custom_metadata)
    except Exception as e:  # noqa: BLE001 - a failed backup must not stop training
      self._failed(step, e)

  def save_older_step(self, step: int, args: Any, metrics: Any,
                      custom_metadata: dict[str, Any] | None, *, newest_ram: int,
                      agreed_persistent: Sequence[int], managed: bool,
                      synchronous: bool) -> None:
    """A forced save of a step older than the newest RAM step (Orbax allows it). RAM
    retention keeps the newest steps, so the RAM tier would retire it at once and could lose
    a newer step for it: it goes to the persistent tier only (docs/api.md).

    Raises:
      StepAlreadyExistsError: the persistent tier has the step.
      ValueError: managed mode, where the RAM tier is the only tier this manager writes.
    """
    directory = self._persistent.directory
    if step in agreed_persistent:
      raise ocp.checkpoint_manager.StepAlreadyExistsError(
          f"Step {step} already exists in the persistent tier {directory}. Delete it "
          f"first with mgr.delete({step}) on every process to save it again.")
    if managed:
      raise ValueError(
          f"save({step}, force=True): step {step} is older than the newest RAM step "
          f"{newest_ram}, and in managed mode the RAM tier is the only tier this manager "
          "writes (its retention keeps the newest steps). Save a newer step, or delete the "
          "newer steps first with mgr.delete(step).")
    logging.warning("orbax-mtc: step %d is older than the newest RAM step %d: saved to the "
                    "persistent tier %s only.", step, newest_ram, directory)
    self.start(step, args, metrics, custom_metadata)
    if synchronous:
      self.poll(block=True)

  def poll(self, *, block: bool = False) -> None:
    """Learns how the backup in flight ended (no collective): a failure is logged once and
    kept for `take_error`; training goes on."""
    step = self._inflight
    if step is None:
      return
    if not block and self._persistent.finalizing():
      return
    try:
      self._persistent.wait()  # raises the background failure, once
    except Exception as e:  # noqa: BLE001 - reported through take_error
      self._failed(step, e)
      return
    self._inflight = None
    # A step Orbax's own preservation policy does not keep is removed as soon as it is
    # saved: it was backed up all the same.
    if step in self._persistent.steps() or self._persistent.retention_drops(
        step, self._inflight_metrics):
      self._error = None  # the newest backup is good: older failures are moot
      self._record(step, "done")
    else:
      self._failed(step, RuntimeError("the step was not finalized"))

  def flush(self, summarize: Callable[[Any, str], Summary]) -> None:
    """Starts the pending backup now and waits for it (every process calls this).

    Args:
      summarize: summarizes one agreement record of every process (summary.py).
    """
    for _ in range(2):  # the pending backup, then the one queued behind it
      pending = self._pending
      if pending is None:
        break
      concurrent.futures.wait([pending.read])
      self.poll(block=True)
      found = summarize(agreement.ReadBackRecord(state=pending.state()),
                        f"the backup of step {pending.step}")
      self._advance_summary(found, Who())
    self.poll(block=True)

  def take_error(self) -> backup.BackupError | None:
    """The newest failure not yet reported (reported once)."""
    error, self._error = self._error, None
    return error

  def _record(self, step: int, state: str, error: str | None = None) -> None:
    last = self.last_backup
    started = last.started_at if last is not None and last.step == step else time.time()
    self.last_backup = backup.BackupInfo(step=step, state=state, started_at=started, error=error)
    self.history.append(self.last_backup)

  def _failed(self, step: int, error: BaseException) -> None:
    self._inflight = None
    self._error = backup.BackupError(step, error)
    self._record(step, "failed", f"{type(error).__name__}: {error}")
    logging.error("orbax-mtc: persistent backup of step %d to %s failed: %s: %s. Training "
                  "goes on; the step stays in the RAM tier and the next scheduled backup "
                  "tries again.", step, self._persistent.directory, type(error).__name__, error)
