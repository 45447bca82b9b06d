"""OnDemandSaver (orbax_mtc/save/ondemand.py) on its own: the real RamSaver on a real
LocalTier, RamWriter, StepLedger and RamRetention in one process, the other processes'
records given by a fake all-gather, and small fakes for the backup scheduler, the peer
copies and the persistent tier."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from conftest import make_state
from part_fakes import LoggedTier

from orbax_mtc import agreement, reduction
from orbax_mtc.agreement import Status
from orbax_mtc.ledger import StepLedger, UnreportedError
from orbax_mtc.local.store import LocalTier
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.save import ondemand, preemption
from orbax_mtc.save.ram import RamSaver
from orbax_mtc.save.retention import RamRetention

_WHAT = "the on-demand save of step 7"
_SPENT = "grace budget is spent"


class _Cluster:
  """This process is process `me` of two; the other answers each agreement with this
  process's record, without its fault, changed by `other[record type]`."""

  def __init__(self, me: int, log: list):
    self.me, self.log = me, log
    self.other: dict[type, dict] = {}
    self.sent: list[tuple[str, object]] = []

  def reduce(self, rnd: reduction.Round, what: str) -> reduction.Parts:
    """The save agreement's rounds: both processes' contributions from their records."""
    mine = rnd.record
    if not self.sent or self.sent[-1][1] is not mine:  # its first round
      self.sent.append((what, mine))
      self.log.append(("agree", what))
    # A listing census (no step) stands for the FinishRecord agreement.
    kind = agreement.FinishRecord if getattr(mine, "step", 0) < 0 else type(mine)
    theirs = dataclasses.replace(mine, **{"fault": agreement.Fault(),
                                          **self.other.get(kind, {})})
    records = [theirs]
    records.insert(self.me, mine)
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))

  def votes(self) -> list[agreement.OnDemandRecord]:
    return [r for _, r in self.sent if isinstance(r, agreement.OnDemandRecord)]


class _Persistent:
  directory = Path("/fake/persistent")

  def __init__(self):
    self.listed: list[int] = []

  def steps(self):
    return list(self.listed)

  def busy(self):
    return False


class _Backups:
  """Records calls; a started (or `inflight`) backup lands in the persistent tier at the
  next blocking poll unless `lands` is False."""

  def __init__(self, log: list, persistent: _Persistent):
    self.log, self.persistent = log, persistent
    self.inflight: int | None = None
    self.lands = True
    self.started: list[tuple] = []

  def wait_for_read(self):
    pass

  def pending_state(self):
    return Status.NONE

  def advance(self, failed, busy, all_ready):
    return False

  def interval_due(self, step, now, saving_anywhere):
    return False

  def drop_pending(self, reason):
    self.log.append(("backups.drop_pending", reason))

  def poll(self, *, block=False):
    self.log.append(("backups.poll", block))
    if block and self.inflight is not None:
      if self.lands:
        self.persistent.listed.append(self.inflight)
      self.inflight = None

  def start(self, step, args, metrics, custom_metadata):
    self.log.append(("backups.start", step))
    self.started.append((step, args, metrics, custom_metadata))
    self.inflight = step


class _Peers:
  def __init__(self, log: list, local: LocalTier, enabled: bool):
    self.log, self.local, self.enabled = log, local, enabled
    self.committed_at_finish: list[int] | None = None

  def progress(self, *, block):
    pass

  def retire_landing(self):
    return None

  def drop_step(self, step):
    self.log.append(("peers.drop_step", step))

  def settle(self, failed=None):
    pass

  def issue(self):
    pass

  def apply_retention(self):
    pass

  ready_call = 1  # the census's copies_ready_call
  calls_since_schedule = 0
  carries_on = False  # the previous step's copies still have chunks to issue

  def take_wait_ms(self):
    return 0

  def adapt(self, waited_ms, clock_ms):
    pass

  def carry(self, step, trees):
    self.log.append(("peers.carry", step))

  def schedule(self, step, trees, start_call=1):
    self.log.append(("peers.schedule", step))

  def finish(self):
    self.log.append("peers.finish")
    self.committed_at_finish = self.local.steps()


@dataclasses.dataclass
class _Rig:
  saver: ondemand.OnDemandSaver
  ram: RamSaver
  cluster: _Cluster
  local: LoggedTier
  backups: _Backups
  peers: _Peers
  persistent: _Persistent
  log: list

  def save(self, step=7, metrics=None, custom_metadata=None, state=None):
    state = state if state is not None else self.state
    return self.saver.save(step, ocp.args.PyTreeSave(state), metrics, custom_metadata)


@pytest.fixture
def rig(shm_dir, mesh, monkeypatch):
  monkeypatch.setattr(preemption, "notice_time", lambda: None)  # no SIGTERM seen here
  made = []

  def build(*, grace=3600.0, read_only=False, managed=False, asynchronous=True,
            peers=True, me=0) -> _Rig:
    log: list = []
    retention = RamRetention(None)
    local = LoggedTier(shm_dir / f"local{len(made)}", log, max_to_keep=None, keep=retention.kept,
                  process_index=me, process_count=2)
    local.prepare()
    cluster = _Cluster(me, log)
    unreported = UnreportedError()
    writer = RamWriter(local, me, 2, asynchronous=asynchronous, on_error=unreported.offer)
    persistent = _Persistent()
    backups, copies = _Backups(log, persistent), _Peers(log, local, peers)
    ledger = StepLedger(process_count=2, process_index=me,
                        reduce=cluster.reduce, own_steps=local.steps,
                        copies=lambda own: [], persistent_steps=persistent.steps,
                        listing_groups=lambda: None, keep=retention.kept,
                        unreported=unreported)
    ram = RamSaver(local=local, writer=writer, ledger=ledger, backups=backups, peers=copies,
                   persistent=persistent, retention=retention, asynchronous=asynchronous)
    saver = ondemand.OnDemandSaver(
        grace_seconds=grace, read_only=read_only, managed=managed, local=local, writer=writer,
        ram=ram, peers=copies, backups=backups, persistent=persistent, ledger=ledger)
    made.append((writer, local))
    r = _Rig(saver, ram, cluster, local, backups, copies, persistent, log)
    r.state = make_state(mesh)
    return r

  yield build
  for writer, local in made:
    writer.shutdown()
    local.close()


def _record_file(r: _Rig, step: int = 7) -> Path:
  return r.local.directory / str(step) / ondemand.ONDEMAND_FILE


def test_the_step_goes_to_ram_then_to_peers_then_to_the_persistent_tier(rig):
  r = rig()
  record = r.save()
  assert r.local.steps() == [7] and r.peers.committed_at_finish == [7]
  assert ("agree", "the save of step 7") in r.log  # through the RAM saver's own agreement
  order = [("local.write", 7), "peers.finish",
           ("backups.drop_pending", "an on-demand checkpoint"), ("backups.poll", True),
           ("agree", _WHAT), ("backups.start", 7), ("backups.poll", True)]  # waited for
  assert [e for e in r.log if e in order] == order
  # Copies of an on-demand step held here are of the same state (an earlier save of it
  # failed elsewhere): kept, unlike a regular save's.
  assert ("peers.drop_step", 7) not in r.log
  (vote,) = r.cluster.votes()
  assert vote.wants_backup and vote.in_budget and not vote.fault.present
  assert record.step == 7 and record.persistent and record.budget_seconds == 3600.0
  assert record.signal_time is None and record.seconds["agreement"] == 0.0
  assert set(record.seconds) == {"agreement", "local", "peers", "persistent", "total"}
  assert r.saver.last is record


def test_the_backup_carries_the_breakdown_and_leaves_the_callers_metadata_alone(rig):
  r = rig(grace=90)
  mine = {"run": "a"}
  r.save(metrics={"loss": 0.25}, custom_metadata=mine)
  ((step, args, metrics, metadata),) = r.backups.started
  assert step == 7 and args.item is r.state and metrics == {"loss": 0.25}
  assert mine == {"run": "a"} and metadata["run"] == "a"
  breakdown = metadata[ondemand.ONDEMAND_METADATA_KEY]
  assert breakdown["step"] == 7 and breakdown["budget_seconds"] == 90.0
  assert breakdown["signal_time"] is None
  assert set(breakdown["seconds"]) == {"agreement", "local", "peers", "persistent"}


def test_ondemand_json_holds_the_record_privately(rig):
  r = rig()
  record = r.save()
  path = _record_file(r)
  assert json.loads(path.read_text()) == dataclasses.asdict(record)
  assert ondemand.read_record(path.parent) == json.loads(record.to_json())
  assert stat.S_IMODE(os.stat(path).st_mode) == r.local.file_mode
  meta = ondemand.ram_step_metadata(r.local, 7)
  assert meta.custom_metadata[ondemand.ONDEMAND_METADATA_KEY]["persistent"] is True


@pytest.mark.parametrize("grace, other_in_budget", [(0.0, True), (3600.0, False)])
def test_no_backup_when_any_process_is_out_of_its_budget(rig, caplog, grace, other_in_budget):
  caplog.set_level("WARNING")
  r = rig(grace=grace)
  r.cluster.other[agreement.OnDemandRecord] = {"in_budget": other_in_budget}
  record = r.save()
  assert r.cluster.votes()[0].in_budget is (grace > 0)  # this process's own answer
  assert r.backups.started == [] and not record.persistent
  assert any(_SPENT in m for m in caplog.messages)
  assert json.loads(_record_file(r).read_text())["persistent"] is False
  assert r.local.steps() == [7]  # the RAM tier holds it all the same


def test_the_budget_counts_from_the_signal(rig, monkeypatch, caplog):
  caplog.set_level("WARNING")
  signal_at = time.time() - 3600  # an hour before this save, a 60 s budget
  monkeypatch.setattr(preemption, "notice_time", lambda: signal_at)
  r = rig(grace=60)
  record = r.save()
  assert record.signal_time == signal_at and record.seconds["agreement"] >= 3600
  assert not r.cluster.votes()[0].in_budget and r.backups.started == []
  assert any(_SPENT in m for m in caplog.messages)


def test_a_signal_time_ahead_of_this_clock_is_not_trusted(rig, monkeypatch):
  monkeypatch.setattr(preemption, "notice_time", lambda: time.time() + 3600)
  r = rig(grace=60)
  record = r.save()
  assert record.signal_time is None and record.seconds["agreement"] == 0.0
  assert r.backups.started[0][3][ondemand.ONDEMAND_METADATA_KEY]["signal_time"] is None
  assert record.persistent  # counted from the agreed step: in budget


def test_a_step_a_backup_in_flight_lands_is_not_backed_up_again(rig, caplog):
  caplog.set_level("WARNING")
  r = rig()
  r.backups.inflight = 7  # Orbax still writes step 7: the blocking poll sees it land
  record = r.save()
  assert not r.cluster.votes()[0].wants_backup and r.backups.started == []
  assert record.persistent and not any(_SPENT in m for m in caplog.messages)


def test_a_process_that_wants_no_backup_stops_it_everywhere_without_warning(rig, caplog):
  caplog.set_level("WARNING")
  r = rig()
  r.cluster.other[agreement.OnDemandRecord] = {"wants_backup": False}
  record = r.save()
  assert r.cluster.votes()[0].wants_backup and r.backups.started == []
  assert not record.persistent and not any(_SPENT in m for m in caplog.messages)


def test_a_backup_that_does_not_land_is_recorded_as_not_persistent(rig):
  r = rig()
  r.backups.lands = False
  record = r.save()
  assert [s for s, *_ in r.backups.started] == [7] and not record.persistent


def test_managed_mode_leaves_the_backup_to_the_replicator(rig, caplog):
  caplog.set_level("WARNING")
  r = rig(managed=True)
  record = r.save()
  assert r.local.steps() == [7] and "peers.finish" in r.log
  assert not r.cluster.votes()[0].wants_backup and r.backups.started == []
  assert not record.persistent and not any(_SPENT in m for m in caplog.messages)
  assert _record_file(r).is_file()


def test_read_only_saves_to_the_persistent_tier_only(rig, caplog):
  caplog.set_level("WARNING")
  r = rig(read_only=True, peers=False)
  record = r.save()
  assert not any(isinstance(rec, agreement.SaveRecord) and rec.step >= 0
                 for _, rec in r.cluster.sent)
  assert ("local.write", 7) not in r.log and r.local.steps() == []
  assert "peers.finish" not in r.log  # no copies to finish
  assert [s for s, *_ in r.backups.started] == [7] and record.persistent
  assert not _record_file(r).exists() and r.saver.last is record
  assert not any("cannot record" in m for m in caplog.messages)  # no folder: not attempted


def test_a_step_every_process_holds_already_is_not_written_again(rig):
  r = rig()
  r.ram.save(7, ocp.args.PyTreeSave(r.state))  # a regular save of the same step
  r.log.clear()
  record = r.save()
  assert ("local.write", 7) not in r.log and ("peers.schedule", 7) not in r.log
  assert "peers.finish" in r.log and record.persistent and _record_file(r).is_file()


def test_a_failed_ram_write_is_raised_everywhere_after_the_backup(rig):
  r = rig(me=1)
  r.local.fail = True
  with pytest.raises(agreement.CheckpointError, match=_WHAT) as e:
    r.save()
  assert list(e.value.origins) == [1] and "No space left" in e.value.origins[1]
  assert r.cluster.votes()[0].fault.kind == "OSError"
  assert [s for s, *_ in r.backups.started] == [7]  # the backup had its chance first
  assert r.saver.last is not None and r.saver.last.persistent
  assert r.local.steps() == [] and not _record_file(r).exists()


def test_another_process_failed_write_is_raised_here_after_the_record(rig):
  r = rig()
  bad = agreement.Fault(kind="OSError", message="No space left on device")
  r.cluster.other[agreement.OnDemandRecord] = {"fault": bad}
  with pytest.raises(agreement.CheckpointError, match=_WHAT) as e:
    r.save()
  assert list(e.value.origins) == [1]
  assert [s for s, *_ in r.backups.started] == [7] and _record_file(r).is_file()


def test_a_failed_synchronous_ram_write_still_lets_the_backup_run(rig):
  r = rig(asynchronous=False)
  r.local.fail = True
  with pytest.raises(agreement.CheckpointError):
    r.save()
  assert [s for s, *_ in r.backups.started] == [7]
