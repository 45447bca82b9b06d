"""The on-demand save: the step every process agreed on after a preemption notice.

When SIGTERM reaches any process (Cloud TPU maintenance with autocheckpoint, a preemption),
`reached_preemption(step)` turns True on every process at the same step (preemption.py). That
step is saved to the RAM tier, then sent to peers, then (within the grace budget) backed up
to the persistent tier, each waited for. Where the time went is recorded in `OnDemandSave`,
in `<local>/<step>/ondemand.json` and in the persistent step's custom metadata.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement, files
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import specs as local_specs
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.save import preemption
from orbax_mtc.save.backup_scheduler import BackupScheduler
from orbax_mtc.save.ram import RamSaver

ONDEMAND_FILE = "ondemand.json"  # in an on-demand step's local folder: its time breakdown
ONDEMAND_METADATA_KEY = "orbax_mtc_ondemand"  # in custom_metadata of the persistent step


@dataclasses.dataclass
class OnDemandSave:
  """The on-demand checkpoint a preemption notice triggered, and where its time went.

  seconds: "agreement" (SIGTERM to the agreed step; 0 when the signal time is unknown),
  "local", "peers", "persistent" and "total" (SIGTERM, or the agreed step, to durable).
  """

  step: int
  signal_time: float | None  # epoch seconds of the first SIGTERM of the job
  budget_seconds: float
  seconds: dict[str, float]
  persistent: bool  # backed up to the persistent tier

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)


class OnDemandSaver:
  """Saves the preemption step through every tier, within the grace budget.

  Args:
    grace_seconds: the budget from SIGTERM to a durable checkpoint.
    read_only: the RAM tier is read-only (the step goes to the persistent tier only).
    managed: GKE's replicator backs the RAM tier up (no persistent save of ours).
    local: this node's RAM tier.
    writer: its writer thread.
    ram: the RAM saver.
    peers: the peer copies.
    backups: the backup scheduler.
    persistent: the persistent tier.
    ledger: the agreed step lists and faults.
  """

  def __init__(self, *, grace_seconds: float, read_only: bool, managed: bool,
               local: local_store.LocalTier, writer: RamWriter, ram: RamSaver, peers: PeerCopies,
               backups: BackupScheduler, persistent: PersistentTier, ledger: StepLedger):
    self._budget = float(grace_seconds)
    self._read_only = read_only
    self._managed = managed
    self._local = local
    self._writer = writer
    self._ram = ram
    self._peers = peers
    self._backups = backups
    self._persistent = persistent
    self._ledger = ledger
    self.last: OnDemandSave | None = None

  def save(self, step: int, args: Any, metrics: Any,
           custom_metadata: dict[str, Any] | None) -> OnDemandSave:
    """Saves `step` on demand (collective: every process calls it for the agreed step).

    Returns:
      Where the time went.

    Raises:
      agreement.CheckpointError: the RAM write failed on some process (after the persistent
        backup, taken from the arrays, had its chance).
    """
    budget = self._budget
    agreed_at = time.time()
    signal_time = preemption.notice_time()
    if signal_time is not None and signal_time > agreed_at:
      signal_time = None  # another host's clock is ahead: the split cannot be trusted
    started = signal_time if signal_time is not None else agreed_at
    seconds = {"agreement": agreed_at - started, "local": 0.0, "peers": 0.0, "persistent": 0.0}
    logging.warning("orbax-mtc: on-demand checkpoint of step %d (%.2fs after SIGTERM, budget "
                    "%.0fs)", step, seconds["agreement"], budget)

    t = time.time()
    if not self._read_only:
      # Whether the step is in RAM already is decided in the save's agreement (rule 8).
      self._ram.save(step, args, ondemand=True)
      self._writer.wait()
    seconds["local"] = time.time() - t

    t = time.time()
    if self._peers.enabled:
      self._peers.finish()
    seconds["peers"] = time.time() - t

    t = time.time()
    self._backups.drop_pending("an on-demand checkpoint")
    self._backups.poll(block=True)  # a backup in flight may be of this very step
    backed_up = step in self._persistent.steps()
    wanted = not backed_up and not self._managed  # managed: the replicator backs it up
    in_budget = time.time() - started < budget  # after the wait above, which may be long
    # Orbax's save has barriers, so every process must take the same branch; their clocks,
    # and when each got here, differ.
    votes = self._ledger.summarize(
        agreement.OnDemandRecord(fault=self._ledger.take_fault(), wants_backup=wanted,
                                 in_budget=in_budget), f"the on-demand save of step {step}")
    wanted = not votes.false("wants_backup")
    in_budget = not votes.false("in_budget")
    if wanted and in_budget:
      metadata = dict(custom_metadata or {})
      metadata[ONDEMAND_METADATA_KEY] = {"step": step, "signal_time": signal_time,
                                         "budget_seconds": budget, "seconds": dict(seconds)}
      self._backups.start(step, args, metrics, metadata)
      self._backups.poll(block=True)
      backed_up = step in self._persistent.steps()
    elif wanted:
      logging.warning("orbax-mtc: no on-demand persistent backup of step %d: the %.0fs grace "
                      "budget is spent (RAM tier and peers hold the step).", step, budget)
    seconds["persistent"] = time.time() - t
    seconds["total"] = time.time() - started

    record = OnDemandSave(step=step, signal_time=signal_time, budget_seconds=budget,
                          seconds=seconds, persistent=backed_up)
    self.last = record
    if step in self._local.steps():
      self._write_record(record)
    level = logging.WARNING if seconds["total"] > budget else logging.INFO
    logging.log(level, "orbax-mtc: on-demand checkpoint of step %d durable %.2fs after the "
                "SIGTERM (budget %.0fs): agreement %.2fs, local %.2fs, peers %.2fs, persistent "
                "%.2fs%s", step, seconds["total"], budget, seconds["agreement"],
                seconds["local"], seconds["peers"], seconds["persistent"],
                "" if backed_up else " (not backed up)")
    # A RAM write that failed somewhere is raised on every process alike, after the
    # persistent backup (taken from the arrays) had its chance.
    self._ledger.raise_summary_faults(votes, f"the on-demand save of step {step}")
    return record

  def _write_record(self, record: OnDemandSave) -> None:
    """Adds ondemand.json to the committed step folder (atomically)."""
    step_dir = self._local.directory / str(record.step)
    try:
      files.write_atomic(step_dir / ONDEMAND_FILE, record.to_json(),
                         mode=self._local.file_mode)  # private, as the step's own files
    except OSError as e:
      logging.warning("orbax-mtc: cannot record the on-demand breakdown in %s: %s", step_dir, e)


def read_record(step_dir: Any) -> dict[str, Any] | None:
  """The on-demand breakdown recorded in a RAM step folder, if any (unreadable: None)."""
  record = step_dir / ONDEMAND_FILE
  if not record.is_file():
    return None
  try:
    return json.loads(record.read_text())
  except (OSError, ValueError):
    return None


def ram_step_metadata(local: local_store.LocalTier, step: int) -> Any:
  """Orbax's `StepMetadata` of a step in this node's RAM tier, with its on-demand breakdown
  (if it was an on-demand save) in `custom_metadata`."""
  manifest = local.manifest(step)
  custom: dict[str, Any] = {}
  record = read_record(local.directory / str(step))
  if record is not None:
    custom[ONDEMAND_METADATA_KEY] = record
  return ocp.metadata.StepMetadata(
      item_metadata=local_specs.item_metadata(manifest),
      commit_timestamp_nsecs=int(manifest.created_at * 1e9), custom_metadata=custom)
