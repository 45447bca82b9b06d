"""Backup schedules: steps or minutes (exactly one), the minutes policy as a pure function, and
backups taken from steps committed in RAM."""

from __future__ import annotations

import contextlib

import pytest
from conftest import abstract_of, assert_trees_equal, make_state

import orbax_mtc as mtc
from orbax_mtc.persistent import orbax_internals
from orbax_mtc.save import backup

T0 = 1_800_000_000.0  # seconds since the epoch


def _options(**persistent):
  return mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=3),
      persistent=mtc.PersistentCheckpointOptions(**persistent),
      replication=mtc.ReplicationOptions(replica_axis="data"))


def test_steps_or_minutes_exactly_one():
  with pytest.raises(ValueError, match="either `save_interval_steps`.*or `backup_interval_minutes`"):
    mtc.PersistentCheckpointOptions(save_interval_steps=100, backup_interval_minutes=30)
  with pytest.raises(ValueError, match="positive number of minutes"):
    mtc.PersistentCheckpointOptions(backup_interval_minutes=0)
  with pytest.raises(ValueError, match="schedule of its own"):
    mtc.PersistentCheckpointOptions(backup_interval_minutes=5, should_save_fn=lambda s, p: True)
  assert mtc.PersistentCheckpointOptions().save_interval_steps == 1000  # the default
  minutes = mtc.PersistentCheckpointOptions(backup_interval_minutes=30)
  assert minutes.save_interval_steps is None and minutes.backup_interval_minutes == 30


@pytest.mark.parametrize("minutes", [0, -1, float("inf"), True, "5"])
def test_policy_rejects_bad_intervals(minutes):
  with pytest.raises(ValueError, match="positive number of minutes"):
    backup.BackupIntervalPolicy(minutes)


def test_interval_policy_over_a_timeline():
  policy = backup.BackupIntervalPolicy(30)
  due = backup.interval_due
  assert due(policy, 10, T0, None, saving=False)  # nothing yet: back up now
  assert not due(policy, 10, T0, None, saving=True)  # never while one is being written
  last = (10, T0)
  assert not due(policy, 20, T0 + 29 * 60, last, saving=False)
  assert due(policy, 30, T0 + 30 * 60, last, saving=False)
  assert not due(policy, 30, T0 + 45 * 60, last, saving=True)
  # A failed attempt counts as an attempt: the retry waits for the next interval.
  failed = (30, T0 + 30 * 60)
  assert not due(policy, 40, T0 + 50 * 60, failed, saving=False)
  assert due(policy, 50, T0 + 60 * 60, failed, saving=False)


def test_minutes_schedule_backs_up_from_ram(shm_dir, mesh):
  """By minutes: the first local save is backed up (nothing persistent yet); the interval
  then holds the next backups back, whatever the step numbers."""
  import orbax.checkpoint as ocp

  options = _options(backup_interval_minutes=60)

  states = {step: make_state(mesh, step) for step in range(4)}
  with mtc.CheckpointManager(shm_dir / "l", shm_dir / "p", mesh, abstract_of(states[0]),
                             options=options) as mgr:
    for step, state in states.items():
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mgr.wait_until_finished()
    assert [info.step for info in mgr.backup_history] == [0]
    assert mgr.last_backup.state == "done"
  plain = ocp.CheckpointManager(shm_dir / "p")
  try:
    assert plain.all_steps() == [0]
    restored = plain.restore(0, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract_of(states[0]))))
    assert_trees_equal(restored.state, states[0])
  finally:
    plain.close()
  # A new manager counts the interval from the newest backup's commit time: no new backup.
  with mtc.CheckpointManager(shm_dir / "l2", shm_dir / "p", mesh, abstract_of(states[0]),
                             options=options) as mgr:
    mgr.save(10, args=ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh, 10))))
    mgr.wait_until_finished()
    assert list(mgr.backup_history) == []


def test_a_failed_backup_is_reported_once_and_training_goes_on(shm_dir, mesh):
  """The store refuses the backup of step 2 (injected at Orbax's save): save() goes on, the
  RAM tier holds the step, wait_until_finished raises BackupError once, the next backup
  lands."""
  import orbax.checkpoint as ocp

  options = _options(save_interval_steps=2)
  states = {step: make_state(mesh, step) for step in range(6)}
  with mtc.CheckpointManager(shm_dir / "l", shm_dir / "p", mesh, abstract_of(states[0]),
                             options=options) as mgr:
    mgr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[0])))
    mgr.wait_until_finished()
    assert mgr.last_backup.state == "done"
    original_save = ocp.CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):
      if step == 2:
        raise OSError(28, "No space left on device (injected)")
      return original_save(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = failing_save
    try:
      for step in (1, 2, 3):
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))
      with pytest.raises(mtc.BackupError, match="backup of step 2 failed") as failure:
        mgr.wait_until_finished()
      assert failure.value.step == 2
      mgr.wait_until_finished()  # reported once
    finally:
      ocp.CheckpointManager.save = original_save
    assert 2 in mgr.all_steps() and 2 not in sorted(ocp.utils.checkpoint_steps(mgr.directory))
    for step in (4, 5):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))
    mgr.wait_until_finished()
    assert [(i.step, i.state) for i in mgr.backup_history] == [
        (0, "done"), (2, "failed"), (4, "done")]


def test_orbax_busy_with_a_metadata_write_defers_the_next_backup(shm_dir, mesh, caplog):
  """Orbax writes step metadata on a thread of its own, with no timeout, and its next save
  waits for it on the calling thread. While such a write hangs (here: on a FIFO nobody reads
  yet), save() goes on and the due backups wait (the oldest keeps its place, the newest waits
  behind it), with one warning once that lasts longer than Orbax's timeout; once the write
  ends, they land. A write that failed is consumed
  before a backup starts, which then lands instead of failing on that old error."""
  import dataclasses
  import os
  import time

  import orbax.checkpoint as ocp

  timeout_s = 2
  options = dataclasses.replace(_options(save_interval_steps=2),
                                async_options=ocp.AsyncOptions(timeout_secs=timeout_s))
  states = {step: make_state(mesh, step) for step in range(7)}

  def save(mgr, step):
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))

  with mtc.CheckpointManager(shm_dir / "l", shm_dir / "p", mesh, abstract_of(states[0]),
                             options=options) as mgr:
    save(mgr, 0)
    mgr.wait_until_finished()
    assert mgr.last_backup.state == "done"
    store = mgr._checkpointer._metadata_store  # the store Orbax's own writes go through
    hung = shm_dir / "hung" / "_CHECKPOINT_METADATA"
    hung.parent.mkdir()
    os.mkfifo(hung)
    store.write(hung, {"hung": True})  # blocks in open() until the FIFO is read
    try:
      assert orbax_internals.orbax_writes_running(mgr._checkpointer)
      assert mgr.is_saving_in_progress()
      for step in (1, 2, 3):
        save(mgr, step)  # returns: nothing waits for the hung write
      assert [(i.step, i.state) for i in mgr.backup_history] == [(0, "done")]
      assert mgr.last_backup.step == 0 and mgr.pending_backup == 2
      waiting = "no backup has started for"
      assert waiting not in caplog.text
      time.sleep(timeout_s + 0.2)  # the time waited is the subject, not an ordering
      for step in (4, 5):
        save(mgr, step)
      assert caplog.text.count(waiting) == 1, caplog.text
      # Rule 12: the due backup of step 2 keeps its place (4 waits behind it), never dropped.
      assert mgr.pending_backup == 2
    finally:
      with open(hung, "rb") as reader:  # the write ends (also when an assert failed)
        written = reader.read()
    assert written == b'{"hung": true}'
    store.write(shm_dir / "missing" / "_CHECKPOINT_METADATA", {})  # fails at once
    store._single_thread_executor.submit(lambda: None).result()  # both writes are over
    assert not orbax_internals.orbax_writes_running(mgr._checkpointer)
    save(mgr, 6)  # the waiting backup of step 2 starts; 4, then 6, follow
    mgr.wait_until_finished()
    assert [(i.step, i.state) for i in mgr.backup_history] == [
        (0, "done"), (2, "done"), (4, "done"), (6, "done")]
    assert sorted(ocp.utils.checkpoint_steps(mgr.directory)) == [0, 2, 4, 6]
    assert orbax_internals.collect_orbax_errors(mgr._checkpointer) == []  # the failure was consumed


def _hold_orbax(mgr, shm_dir):
  """Makes Orbax's next metadata write hang on a FIFO until `release` reads it; Orbax's next
  save waits for that write, so every backup due meanwhile queues up."""
  import os

  hung = shm_dir / "hung" / "_CHECKPOINT_METADATA"
  hung.parent.mkdir()
  os.mkfifo(hung)
  store = mgr._checkpointer._metadata_store  # the store Orbax's own writes go through
  store.write(hung, {"hung": True})  # blocks in open() until the FIFO is read
  released: list[bytes] = []

  def release() -> None:
    if not released:
      with open(hung, "rb") as reader:
        released.append(reader.read())
      store._single_thread_executor.submit(lambda: None).result()  # the write is over
  return release, released


@contextlib.contextmanager
def _held_after_step_0(shm_dir, mesh, options, states):
  """A manager that has backed up step 0, with Orbax then held (`_hold_orbax`):
  yields (manager, release, released)."""
  import orbax.checkpoint as ocp

  with mtc.CheckpointManager(shm_dir / "l", shm_dir / "p", mesh, abstract_of(states[0]),
                             options=options) as mgr:
    mgr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[0])))
    mgr.wait_until_finished()
    yield (mgr, *_hold_orbax(mgr, shm_dir))


@pytest.mark.parametrize("skip", [False, True], ids=["wait", "skip"])
def test_every_due_step_is_backed_up_unless_skipping_is_asked_for(shm_dir, mesh, monkeypatch,
                                                                  caplog, skip):
  """Persistent every 4 steps, local every step, while the backup of step 0 is still being
  written (Orbax held on a metadata write): 4 waits for Orbax, 8 waits behind it, and 12
  finds the queue full. By default the save of 12 waits for the earlier backup, as Orbax's
  own save does, and every due step lands (before: 8 was dropped, logged at INFO only). With
  skip_backups_when_busy=True, 8 is skipped with a warning, and listed by `orbax-mtc
  status`."""
  import orbax.checkpoint as ocp

  from orbax_mtc.save import backup_scheduler
  from orbax_mtc.tools import inspection

  options = _options(save_interval_steps=4, skip_backups_when_busy=skip)
  states = {step: make_state(mesh, step) for step in range(13)}
  with _held_after_step_0(shm_dir, mesh, options, states) as (mgr, release, released):
    make_room = backup_scheduler.BackupScheduler._make_room
    waited_at: list[int] = []

    def releasing(scheduler, agree, newer):
      waited_at.append(scheduler.pending_step)
      release()  # the held write ends now that a save waits for it
      return make_room(scheduler, agree, newer)
    monkeypatch.setattr(backup_scheduler.BackupScheduler, "_make_room", releasing)
    try:
      for step in range(1, 13):
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))
    finally:
      release()
    assert released == [b'{"hung": true}']
    mgr.wait_until_finished()
    persistent = sorted(ocp.utils.checkpoint_steps(mgr.directory))
    waits = mgr.backup_waits
    if skip:
      assert persistent == [0, 4, 12]
      assert waited_at == [] and waits.count == 0 and waits.skipped == (8,)
      assert (8, "skipped") in [(i.step, i.state) for i in mgr.backup_history]
      assert "the backup of step 8 is skipped (skip_backups_when_busy" in caplog.text
    else:
      assert persistent == [0, 4, 8, 12]
      assert waited_at == [4] and waits.count == 1 and waits.seconds > 0
      assert waits.skipped == ()
      assert [(i.step, i.state) for i in mgr.backup_history] == [
          (0, "done"), (4, "done"), (8, "done"), (12, "done")]
    restored = mgr.restore(8 if not skip else 12)
    assert_trees_equal(restored.state, states[8 if not skip else 12])
  document = inspection.document("status", "local", str(shm_dir / "l"), [])
  assert document["skipped_backups"] == ([8] if skip else [])


def test_a_storage_write_that_hangs_past_orbax_timeout_is_not_waited_for(shm_dir, mesh,
                                                                         caplog):
  """The wait for room lasts at most Orbax's async timeout: a write still hanging then is a
  storage fault, and Orbax would fail the backup anyway; the step waiting behind it is
  skipped with a warning and training goes on (the GCS outage tests run this in two
  processes against a frozen server)."""
  import dataclasses

  import orbax.checkpoint as ocp

  options = dataclasses.replace(_options(save_interval_steps=4),
                                async_options=ocp.AsyncOptions(timeout_secs=1))
  states = {step: make_state(mesh, step) for step in range(13)}
  with _held_after_step_0(shm_dir, mesh, options, states) as (mgr, release, _):
    try:
      for step in range(1, 13):  # returns although the write never ends meanwhile
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))
      assert mgr.backup_waits.skipped == (8,) and mgr.pending_backup == 4
    finally:
      release()
    mgr.wait_until_finished()
    assert sorted(ocp.utils.checkpoint_steps(mgr.directory)) == [0, 4, 12]
  assert "the backup of step 8 is skipped (the backup before it still runs after Orbax's " \
      "timeout (1 s): a storage write hangs)" in caplog.text


def test_skip_backups_when_busy_must_be_a_bool():
  with pytest.raises(TypeError, match="skip_backups_when_busy must be True or False"):
    mtc.PersistentCheckpointOptions(skip_backups_when_busy="yes")
