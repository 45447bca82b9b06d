"""RamSaver (orbax_mtc/save/ram.py) on its own: a real LocalTier, RamWriter, StepLedger and
RamRetention in one process, the other processes' records given by a fake all-gather, and
small fakes for the backup scheduler, the peer copies and the persistent tier."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from conftest import make_state
from part_fakes import LoggedTier

from orbax_mtc import agreement, reduction
from orbax_mtc.agreement import Status
from orbax_mtc.ledger import StepLedger, UnreportedError
from orbax_mtc.local import aside
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.process_state import ProcessJsonSave
from orbax_mtc.reduction import Who
from orbax_mtc.save.ram import RamSaver
from orbax_mtc.save.retention import RamRetention


class _Cluster:
  """This process sits at index `me`; each other process answers an agreement with this
  process's record, without its fault, changed by `others[record type][i]`."""

  def __init__(self, count: int, me: int, log: list):
    self.count, self.me, self.log = count, me, log
    self.others: dict[type, list[dict]] = {}
    self.sent: list[tuple[str, object]] = []  # (what, this process's decoded record)

  def reduce(self, rnd: reduction.Round, what: str) -> reduction.Parts:
    """The save agreement's rounds: every process's contribution from its record."""
    mine = rnd.record
    if not self.sent or self.sent[-1][1] is not mine:  # its first round
      self.sent.append((what, mine))
      self.log.append(("agree", what))
    # A listing census (no step) stands for the FinishRecord agreement.
    kind = agreement.FinishRecord if mine.step < 0 else type(mine)
    changes = self.others.get(kind, [{}] * (self.count - 1))
    records = [dataclasses.replace(mine, **{"fault": agreement.Fault(), **c}) for c in changes]
    records.insert(self.me, mine)
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))


class _Backups:
  def __init__(self, log: list):
    self.log = log
    self.state, self.starts, self.due = Status.NONE, False, False
    self.advanced, self.due_asked, self.scheduled = [], [], []  # calls, in order

  def wait_for_read(self):
    self.log.append("backups.wait_for_read")

  def pending_state(self):
    return self.state

  def advance(self, failed, busy, all_ready):
    self.advanced.append((failed, busy, all_ready))
    return self.starts

  def interval_due(self, step, now, saving_anywhere):
    self.due_asked.append((step, now, saving_anywhere))
    return self.due

  def schedule(self, step, args, trees, jsons, metrics, custom_metadata, now, agree):
    self.log.append(("backups.schedule", step))
    self.scheduled.append(dict(step=step, trees=trees, metrics=metrics,
                               custom_metadata=custom_metadata, now=now))

  def flush(self, agree):
    self.log.append("backups.flush")


class _Peers:
  def __init__(self, log: list):
    self.log, self.trees = log, {}  # trees: step -> the trees scheduled for copies
    self.start_calls: dict[int, int] = {}  # step -> the call its copies start at

  def progress(self, *, block):
    self.log.append(("peers.progress", block))

  def retire_landing(self):
    self.log.append("peers.retire_landing")
    return None

  def drop_step(self, step):
    self.log.append(("peers.drop_step", step))

  def settle(self, failed=None):
    self.log.append("peers.settle")

  def issue(self):
    self.log.append("peers.issue")

  def apply_retention(self):
    self.log.append("peers.apply_retention")

  ready_call = 1  # the census's copies_ready_call
  calls_since_schedule = 19  # the interval: 20 calls
  carries_on = False  # the previous step's copies still have chunks to issue
  wait_ms = 0  # what this process's calls waited for copies (the census's field)

  def take_wait_ms(self):
    return self.wait_ms

  def adapt(self, waited_ms, clock_ms):
    self.log.append(("peers.adapt", waited_ms))

  def carry(self, step, trees):
    self.log.append(("peers.carry", step))

  def schedule(self, step, trees, start_call=1):
    self.log.append(("peers.schedule", step))
    self.trees[step] = trees
    self.start_calls[step] = start_call


class _Persistent:
  directory = Path("/fake/persistent")

  def __init__(self):
    self.listed, self.is_busy = [], False

  def steps(self):
    return list(self.listed)

  def busy(self):
    return self.is_busy


class _Rig(types.SimpleNamespace):
  def save(self, step, state, **kwargs):
    self.saver.save(step, ocp.args.PyTreeSave(state), **kwargs)
    self.writer.wait()  # an async write done (its error, if any, kept for the agreement)


@pytest.fixture
def rig(shm_dir):
  made = []

  def build(*, count=2, me=0, asynchronous=False, max_to_keep=None) -> _Rig:
    log: list = []
    retention = RamRetention(max_to_keep)
    local = LoggedTier(shm_dir / f"local{len(made)}", log, max_to_keep=max_to_keep,
                  keep=retention.kept, process_index=me, process_count=count)
    local.prepare()
    cluster = _Cluster(count, me, log)
    unreported = UnreportedError()
    writer = RamWriter(local, me, count, asynchronous=asynchronous, on_error=unreported.offer)
    persistent, backups, peers = _Persistent(), _Backups(log), _Peers(log)
    ledger = StepLedger(process_count=count, process_index=me,
                        reduce=cluster.reduce,
                        own_steps=local.steps, copies=lambda own: [],
                        persistent_steps=persistent.steps, listing_groups=lambda: None,
                        keep=retention.kept, unreported=unreported)
    saver = RamSaver(local=local, writer=writer, ledger=ledger, backups=backups, peers=peers,
                     persistent=persistent, retention=retention, asynchronous=asynchronous)
    made.append((writer, local))
    return _Rig(saver=saver, cluster=cluster, local=local, writer=writer, ledger=ledger,
                backups=backups, peers=peers, persistent=persistent, retention=retention,
                log=log)

  yield build
  for writer, local in made:
    writer.shutdown()
    local.close()


def _save_records(r: _Rig) -> list:
  # A listing census (ledger.agree_steps) is a SaveRecord without a step.
  return [(w, x) for w, x in r.cluster.sent
          if isinstance(x, agreement.SaveRecord) and x.step >= 0]


def test_the_save_agreement_carries_the_step_and_this_process_facts(rig, mesh):
  r = rig(me=1)
  state = make_state(mesh)
  r.save(2, state)
  r.persistent.listed, r.persistent.is_busy = [0], True
  r.backups.state = Status.READING
  r.log.clear()
  r.save(4, state, backup_wanted=True)
  (what, record), = _save_records(r)[1:]
  assert what == "the save of step 4"
  assert record.step == 4 and not record.fault.present
  assert record.inventory.own_steps == (2,) and record.inventory.persistent_steps == (0,)
  assert not record.has_step_in_ram and not record.has_step_persistent
  assert record.wants_backup and record.orbax_busy and record.clock_ms > 0
  assert record.backup_state == Status.READING  # the scheduler gets both processes' figures:
  assert r.backups.advanced[-1] == (Who(0, -1), Who(2, 0), False)
  # The read-back is done before the agreement; the outcome of the copies issued earlier
  # right after it (the census counts only what the writer committed before), before the
  # new write; the previous step's copies go out once the new write is issued.
  agreed = r.log.index(("agree", "the save of step 4"))
  assert agreed < r.log.index("peers.settle") < r.log.index(("local.write", 4))
  # Copies kept only as the previous floor go once the census moved it, before the write
  # (and so before this step's copies arrive: the next copy reuses a retired one's file).
  assert agreed < r.log.index("peers.apply_retention") < r.log.index(("local.write", 4))
  assert r.log.index("backups.wait_for_read") < agreed
  assert r.log.index(("local.write", 4)) < r.log.index("peers.issue") < \
      r.log.index(("peers.schedule", 4))


def test_the_copies_start_at_the_call_the_slowest_previous_write_was_done_by(rig, mesh):
  """Each process reports the first call after its previous save that found that write done
  (`PeerCopies.ready_call`, 1 here); the census's maximum, a write that outlasted a call, sets
  where the step's copies start (one call later: their read-ahead), the same on every
  process."""
  r = rig(count=3)
  r.cluster.others[agreement.SaveRecord] = [{"copies_ready_call": 4}, {}]
  r.save(4, make_state(mesh))
  assert r.peers.start_calls == {4: 5}
  r.cluster.others[agreement.SaveRecord] = [{}, {}]
  r.save(5, make_state(mesh))
  assert r.peers.start_calls[5] == 1  # every write done by the first call: that one


def test_the_census_carries_the_most_any_process_waited_for_copies_to_the_spread(rig, mesh):
  """Each process reports how long its calls waited for the copies' chunks since the last
  save; the census's maximum, the same on every process, is what the spread adapts to."""
  r = rig(count=3)
  r.peers.wait_ms = 40
  r.cluster.others[agreement.SaveRecord] = [{"copies_wait_ms": 250}, {"copies_wait_ms": 7}]
  r.save(4, make_state(mesh))
  (_, record), = _save_records(r)
  assert record.copies_wait_ms == 40
  assert ("peers.adapt", 250) in r.log
  # After the agreement (its answer), before the step's copies are planned.
  assert r.log.index(("agree", "the save of step 4")) < r.log.index(("peers.adapt", 250)) < \
      r.log.index(("peers.schedule", 4))


@pytest.mark.parametrize("ondemand", [False, True])
def test_copies_still_going_out_carry_on_instead_of_this_steps(rig, mesh, ondemand):
  """A save that finds the previous step's copies with chunks still to issue (the link
  lags their spread) lets them go on over the next interval and plans no copies of its own
  step, instead of issuing them all and waiting for them; an on-demand save (the step a
  preempted job restores) issues them and sends its own step's copies."""
  r = rig()
  state = make_state(mesh)
  r.save(2, state)
  r.peers.carries_on = True
  r.log.clear()
  r.save(4, state, ondemand=ondemand)
  sent = [e for e in r.log if e == "peers.issue" or e[0] in ("peers.carry", "peers.schedule")]
  # Carried: the save names its own step, which a wait sends if no later save's copies do.
  assert sent == (["peers.issue", ("peers.schedule", 4)] if ondemand else [("peers.carry", 4)])
  assert r.local.steps() == [2, 4]  # the step is saved either way


def test_processes_saving_different_steps_raise_naming_each_and_write_nothing(rig, mesh):
  r = rig(count=3)
  r.cluster.others[agreement.SaveRecord] = [{}, {"step": 5}]
  with pytest.raises(ValueError, match=r"process 0 and 1 other process\(es\): 4, process 2: 5"):
    r.save(4, make_state(mesh))
  assert r.local.steps() == [] and ("local.write", 4) not in r.log
  assert r.peers.trees == {} and r.backups.advanced == []


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_step_in_ram_everywhere_is_backed_up_from_ram_not_written_again(rig, mesh,
                                                                          asynchronous):
  r = rig(me=1, asynchronous=asynchronous)
  r.cluster.others[agreement.SaveRecord] = [{"clock_ms": 1_234_000}]  # process 0's clock
  state = make_state(mesh)
  r.save(2, state)
  r.log.clear()
  r.save(2, state, backup_wanted=True, metrics={"loss": 1.0}, custom_metadata={"k": 1})
  assert not {("local.write", 2), ("local.delete", 2), ("peers.schedule", 2)} & set(r.log)
  (job,) = r.backups.scheduled
  assert job["step"] == 2 and job["now"] == 1234.0 and job["metrics"] == {"loss": 1.0}
  assert job["custom_metadata"] == {"k": 1} and job["trees"]["default"] is state
  assert ("backups.flush" in r.log) is (not asynchronous)  # synchronous: done on return
  assert r.local.steps() == [2]


def test_a_step_in_ram_everywhere_without_a_backup_due_is_refused(rig, mesh):
  r = rig()
  state = make_state(mesh)
  r.save(2, state)
  r.log.clear()
  with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError) as e:
    r.save(2, state)
  assert str(r.local.directory) in str(e.value) and "mgr.delete(2)" in str(e.value)
  assert "only" not in str(e.value)  # every process holds it
  assert ("local.write", 2) not in r.log and r.backups.scheduled == []


@pytest.mark.parametrize("change, where", [
    ({"has_step_in_ram": True}, r"RAM tier \S+ of process\(es\) \[1\] only"),
    ({"has_step_persistent": True}, r"RAM tier \S+ or persistent tier /fake/persistent"),
])
def test_a_step_present_on_some_process_raises_step_already_exists(rig, mesh, change, where):
  r = rig(count=3)
  r.cluster.others[agreement.SaveRecord] = [change, {}]
  with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError, match=where):
    r.save(4, make_state(mesh), backup_wanted=True)
  assert r.local.steps() == [] and ("local.write", 4) not in r.log
  assert r.backups.scheduled == [] and r.peers.trees == {}


def test_a_step_orbax_just_saved_is_mirrored_into_ram(rig, mesh):
  r = rig()
  r.persistent.listed = [4]  # the parent-style form: Orbax's save wrote it a moment ago
  r.save(4, make_state(mesh), parent_saved=True)
  assert r.local.steps() == [4] and ("peers.schedule", 4) in r.log
  # A copy of step 4 held here is of a timeline the job left: gone before the write.
  assert r.log.index(("peers.drop_step", 4)) < r.log.index(("local.write", 4))
  assert _save_records(r)[0][1].has_step_persistent


@pytest.mark.parametrize("remote", [False, True])
def test_an_item_error_of_one_process_is_raised_on_every_process(rig, mesh, remote):
  r = rig(me=1)
  state = make_state(mesh)
  if remote:  # process 0 could not encode its value: here only its record says so
    bad = agreement.Fault(kind="TypeError", message="Item 'it': not JSON")
    r.cluster.others[agreement.SaveRecord] = [{"fault": bad}]
    value, culprit = {"epoch": 1}, 0
  else:
    value, culprit = {1, 2}, 1  # a set is no JSON value
  args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), it=ProcessJsonSave(value))
  with pytest.raises(agreement.CheckpointError, match=r"the save of step 4") as e:
    r.saver.save(4, args)
  assert list(e.value.origins) == [culprit]
  assert e.value.origins[culprit].startswith("TypeError: Item 'it'")
  assert _save_records(r)[0][1].fault.present is (not remote)
  assert r.local.steps() == [] and ("local.write", 4) not in r.log and r.peers.trees == {}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_write_is_raised_through_an_agreement_naming_this_process(rig, mesh,
                                                                           asynchronous):
  r = rig(me=1, asynchronous=asynchronous)
  state = make_state(mesh)
  r.local.fail = True
  if asynchronous:
    r.save(2, state)  # returns: the error waits for the next agreement
    with pytest.raises(agreement.CheckpointError, match="the save of step 4") as e:
      r.save(4, state)
    assert ("local.write", 4) not in r.log
  else:  # the synchronous save ends with an agreement that carries it
    with pytest.raises(agreement.CheckpointError, match="the save of step 2") as e:
      r.save(2, state)
  assert list(e.value.origins) == [1] and "No space left" in e.value.origins[1]
  assert isinstance(e.value.__cause__, OSError)
  assert r.local.steps() == []


@pytest.mark.parametrize("mine, other, due, scheduled", [
    (False, False, False, False),
    (True, False, False, True),
    (False, True, False, True),  # any process's wish counts
    (False, False, True, True),  # due by minutes
])
def test_the_backup_is_scheduled_only_when_wanted_or_due(rig, mesh, mine, other, due,
                                                         scheduled):
  r = rig()
  r.cluster.others[agreement.SaveRecord] = [{"wants_backup": other}]
  r.backups.due = due
  r.save(4, make_state(mesh), backup_wanted=mine)
  assert [j["step"] for j in r.backups.scheduled] == ([4] if scheduled else [])
  # The interval is asked only when no process wants the step anyway.
  assert [s for s, _, _ in r.backups.due_asked] == ([] if mine or other else [4])
  assert r.local.steps() == [4]
  if scheduled:  # synchronous: the backup is flushed before the copies are scheduled
    assert r.log.index(("backups.schedule", 4)) < r.log.index("backups.flush") < \
        r.log.index(("peers.schedule", 4))


@pytest.mark.parametrize("busy_elsewhere, started, anywhere", [
    (False, False, False), (True, False, True), (False, True, True)])
def test_the_interval_check_learns_whether_a_backup_runs_anywhere(rig, mesh, busy_elsewhere,
                                                                  started, anywhere):
  r = rig(me=1)
  r.cluster.others[agreement.SaveRecord] = [{"orbax_busy": busy_elsewhere,
                                             "clock_ms": 7_000}]
  r.backups.starts = started
  r.save(4, make_state(mesh))
  assert r.backups.due_asked == [(4, 7.0, anywhere)]  # process 0's clock, agreed


@pytest.mark.parametrize("asynchronous", [False, True])
def test_peers_get_the_saved_step_and_a_synchronous_save_sends_it(rig, mesh, asynchronous):
  r = rig(asynchronous=asynchronous)
  state = make_state(mesh)
  r.saver.save(4, ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
  assert list(r.peers.trees) == [4] and r.peers.trees[4]["state"] is state
  tail = r.log[r.log.index(("peers.schedule", 4)):]
  if asynchronous:
    assert tail == [("peers.schedule", 4)]  # copies go out during the next saves
  else:
    assert r.log.index(("local.write", 4)) < r.log.index(("peers.schedule", 4))
    assert tail == [("peers.schedule", 4), ("peers.progress", True),
                    ("agree", "the save of step 4")]
  r.writer.wait()
  assert r.local.steps() == [4]


def test_retention_records_the_agreed_clock_and_forgets_steps_not_held(rig, mesh):
  r = rig(me=1)
  r.cluster.others[agreement.SaveRecord] = [{"clock_ms": 5_000_000}]
  r.retention.record(99, 1.0, {"old": True})  # a step no process holds any more
  r.save(4, make_state(mesh), metrics={"loss": 0.5})
  assert r.retention.saved_at(4) == 5000.0  # process 0's clock, not this one's
  assert r.retention.metrics_of(4) == {"loss": 0.5}
  assert r.retention.saved_at(99) == 0.0 and r.retention.metrics_of(99) is None


def test_the_newest_step_every_process_holds_is_kept_beyond_max_to_keep(rig, mesh):
  alone = rig(count=1, max_to_keep=1)  # one process: no floor
  for step in (2, 4, 6):
    alone.save(step, make_state(mesh))
  assert alone.local.keep_floor is None and alone.local.steps() == [6]
  r = rig(max_to_keep=1)
  state = make_state(mesh)
  r.save(2, state)
  r.save(4, state)
  assert r.local.steps() == [2, 4]  # 2 was the newest step both held when 4 was saved
  r.cluster.others[agreement.SaveRecord] = [
      {"inventory": agreement.Inventory.of([2], [], [])}]  # process 1 never committed 4
  r.save(6, state)
  assert r.local.keep_floor == 2
  assert r.local.steps() == [2, 6]
  assert r.ledger.ram == (2, 6)


def test_an_ondemand_step_in_ram_everywhere_is_not_written_again(rig, mesh):
  r = rig()
  state = make_state(mesh)
  r.save(4, state)
  r.log.clear()
  r.save(4, state, ondemand=True, backup_wanted=True)
  assert [e for e in r.log if e[0] in ("local.write", "local.delete", "peers.schedule",
                                       "backups.schedule")] == []
  assert r.local.steps() == [4]


@pytest.mark.parametrize("held_here", [True, False])
def test_an_ondemand_step_in_some_folders_is_written_again_everywhere(rig, mesh, held_here):
  r = rig()
  state = make_state(mesh)
  r.save(2, state)
  if held_here:
    r.save(4, state)
  # The other process holds step 4 exactly when this one does not.
  r.cluster.others[agreement.SaveRecord] = [{"has_step_in_ram": not held_here}]
  r.log.clear()
  r.save(4, make_state(mesh, seed=1), ondemand=True)  # no StepAlreadyExistsError
  steps = [e for e in r.log if e[0] in ("local.write", "local.replace", "local.delete")]
  # Never deleted before the rewrite commits (rule 10): the folder here is set aside then.
  assert steps == [("local.write", 4)] + (
      [("local.replace", 4, aside.REPLACED)] if held_here else [])
  assert r.local.steps() == [2, 4] and ("peers.schedule", 4) in r.log
  assert ("peers.drop_step", 4) not in r.log  # copies of the same state: kept


def test_a_save_that_cannot_be_staged_lists_no_step(rig, mesh):
  r = rig()
  args = ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh)),
                            meta=ocp.args.JsonSave({1, 2}))  # no JSON value: nothing staged
  with pytest.raises(TypeError, match="not JSON-serialisable"):
    r.saver.save(4, args)
  assert r.local.steps() == []
  assert r.ledger.ram == ()  # all_steps()/latest_step() would name step 4, written nowhere
