"""The agreed step lists and faults (orbax_mtc.ledger), with the other processes' records
given as rows or, for the reduced agreements, added up in numpy: no JAX, no collective."""

from __future__ import annotations

import pytest

from orbax_mtc import agreement, reduction
from orbax_mtc.ledger import StepLedger
from orbax_mtc.save import backup
from orbax_mtc.save.retention import RamRetention


class _Cluster:
  """Process 0's ledger; the other processes' next records are queued as rows."""

  def __init__(self, process_count: int, *, own=(), copies=(), persistent=(), groups=None,
               max_to_keep=None):
    self.others: list[object] = []
    self.waited: list[bool] = []
    self.whats: list[str] = []
    self.own, self.persistent = list(own), list(persistent)
    self.ledger = StepLedger(
        process_count=process_count, own_steps=lambda: self.own,
        copies=lambda own: list(copies), persistent_steps=lambda: self.persistent,
        listing_groups=lambda: groups, keep=RamRetention(max_to_keep).kept,
        before_local_raise=lambda: self.waited.append(True), reduce=self._reduce)
    self._current: tuple[object, list] | None = None  # this agreement: my record, theirs

  def _reduce(self, rnd: reduction.Round, what: str) -> reduction.Parts:
    """The other processes' queued records, added to this one's in every round of one
    agreement (a listing census reads FinishRecord's fields from a SaveRecord)."""
    if self._current is None or self._current[0] is not rnd.record:
      self.whats.append(what)
      others, self.others = self.others, []
      self._current = (rnd.record, [agreement.SaveRecord(
          step=rnd.record.step, fault=o.fault, inventory=o.inventory) for o in others])
    records = [rnd.record, *self._current[1]]
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))



_NO_FAULT = agreement.Fault()


def _finish(own=(), copies=(), persistent=(), fault=_NO_FAULT):
  return agreement.FinishRecord(fault=fault,
                                inventory=agreement.Inventory.of(own, copies, persistent))


def test_agreed_steps_are_what_every_process_can_serve():
  cluster = _Cluster(2, own=[4, 6, 8], persistent=[0, 5])
  cluster.others = [_finish(own=[4, 6], persistent=[0])]
  cluster.ledger.agree_steps("reload")
  assert cluster.ledger.ram == (4, 6)  # step 8 is on process 0 only
  assert cluster.ledger.persistent == (0,)  # process 1 does not see step 5 yet
  assert cluster.whats == ["reload"]


def test_a_peer_copy_makes_a_step_assemblable():
  # Process 1 lost its folder; process 0 holds a copy of its step 6.
  cluster = _Cluster(2, own=[6], copies=[(1, 6)])
  cluster.others = [_finish()]
  cluster.ledger.agree_steps("start")
  assert cluster.ledger.ram == (6,)


def test_a_local_fault_anywhere_is_raised_everywhere_naming_the_process():
  cluster = _Cluster(3)
  boom = agreement.Fault(kind="OSError", message="No space left on device")
  cluster.others = [_finish(), _finish(fault=boom)]
  with pytest.raises(agreement.CheckpointError, match=r"process\(es\) \[2\].*No space") as e:
    cluster.ledger.agree_steps("wait_until_finished")
  assert e.value.origins == {2: "OSError: No space left on device"}
  assert cluster.waited == [True]  # a backup in flight finishes before the error ends the program


def test_this_process_writer_error_travels_in_the_next_agreement_once():
  cluster = _Cluster(2)
  assert cluster.ledger.note_local_error(OSError(28, "full"))
  assert not cluster.ledger.note_local_error(OSError(28, "again"))  # kept: the first one
  cluster.others = [_finish()]
  with pytest.raises(agreement.CheckpointError, match=r"process\(es\) \[0\]") as e:
    cluster.ledger.agree_steps("save")
  assert isinstance(e.value.__cause__, OSError)
  cluster.others = [_finish()]
  cluster.ledger.agree_steps("save")  # reported once


def test_a_failed_backup_is_reported_when_no_local_fault_is():
  cluster = _Cluster(2)
  failure = backup.BackupError(4, RuntimeError("503"))
  cluster.others = [_finish()]
  with pytest.raises(backup.BackupError) as e:
    cluster.ledger.agree_steps("wait_until_finished", backup_error=lambda: failure)
  assert e.value is failure
  # Another process's failed backup: the same error here.
  remote = agreement.Fault(kind="RuntimeError", message="503", backup_step=4)
  cluster.others = [_finish(fault=remote)]
  with pytest.raises(backup.BackupError, match="backup of step 4 failed.*process 1"):
    cluster.ledger.agree_steps("wait_until_finished", backup_error=lambda: None)


def test_a_saved_step_is_retained_with_the_floor():
  cluster = _Cluster(2, max_to_keep=1)
  inventories = [agreement.Inventory.of([6], [], []), agreement.Inventory.of([4, 6], [], [])]
  cluster.ledger.adopt(inventories, saved=8, floor=6)
  assert cluster.ledger.ram == (6, 8)  # the newest step every node holds stays
  cluster.ledger.forget(6)
  assert cluster.ledger.ram == (8,)
