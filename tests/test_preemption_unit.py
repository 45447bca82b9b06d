"""SIGTERM handling inside one process: step ids, our own handler, the on-demand save.

The multi-process behaviour (JAX's sync point, real `kill -TERM` from outside, exit status)
is in test_preemption.py; here real signals go to this process, which has no
`jax.distributed`, so the manager installs its own handler.
"""

from __future__ import annotations

import json
import os
import signal

import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, assert_trees_equal, make_state

from orbax_mtc.local.lock import LocalDirectoryLock
from orbax_mtc.local.store import committed_steps
from orbax_mtc.save import preemption
from orbax_mtc.save.backup_scheduler import BackupScheduler


@pytest.fixture
def fresh_state(monkeypatch):
  """A process state of our own, so that ids and signals of other tests do not leak in."""
  state = preemption._ProcessState()
  monkeypatch.setattr(preemption, "_STATE", state)
  before = signal.getsignal(signal.SIGTERM)
  yield state
  while state.recorder._users:
    state.recorder.release()
  signal.signal(signal.SIGTERM, before)


class _FakeSyncManager:
  """XLA's protocol in miniature: on a notice the sync id becomes (last id asked) + 1."""

  def __init__(self):
    self.last = 0
    self.sync: int | None = None
    self.asked: list[int] = []

  def notice(self):
    self.sync = self.last + 1

  def reached(self, step_id: int) -> bool:
    self.asked.append(step_id)
    self.last = step_id
    return self.sync == step_id


def test_jumping_steps_get_consecutive_ids(fresh_state, monkeypatch):
  fake = _FakeSyncManager()
  monkeypatch.setattr(preemption, "jax_sync_available", lambda: True)
  monkeypatch.setattr(preemption.multihost_utils, "reached_preemption_sync_point", fake.reached)
  steps = [100, 103, 106, 109]
  assert [preemption.reached(s) for s in steps] == [False] * 4
  assert fake.asked == [1, 2, 3, 4]  # the user's steps would never have fired (109 != 101)
  fake.notice()
  assert preemption.reached(112) is True
  assert preemption.reached(112) is True  # asked again (save, then the loop): same answer
  assert fake.asked == [1, 2, 3, 4, 5]
  assert preemption.reached(115) is False
  assert preemption.known_answer(112) is True and preemption.known_answer(999) is False


def test_disabled_preemption_service_answers_false(fresh_state, monkeypatch):
  def disabled(step_id):
    raise RuntimeError("Preemption sync manager has not been initialized.")

  monkeypatch.setattr(preemption, "jax_sync_available", lambda: True)
  monkeypatch.setattr(preemption.multihost_utils, "reached_preemption_sync_point", disabled)
  assert preemption.reached(1) is False


def test_own_handler_fires_once_at_next_new_step_and_chains(fresh_state):
  calls = []
  signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
  assert preemption.attach(process_count=1) is True
  assert preemption.reached(0) is False
  assert preemption.notice_time() is None
  os.kill(os.getpid(), signal.SIGTERM)
  os.kill(os.getpid(), signal.SIGTERM)  # a second notice neither kills nor moves the step
  assert calls == [signal.SIGTERM, signal.SIGTERM]
  assert preemption.sigterm_count() == 2
  assert preemption.notice_time() is not None
  assert preemption.reached(0) is False  # already answered before the signal
  assert preemption.reached(7) is True
  assert preemption.reached(7) is True
  assert preemption.reached(8) is False
  preemption.detach()
  assert signal.getsignal(signal.SIGTERM) is not fresh_state.recorder._on_sigterm


def test_multi_process_without_preemption_service_installs_nothing(fresh_state):
  before = signal.getsignal(signal.SIGTERM)
  assert preemption.attach(process_count=4) is False
  assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("text, expected", [
    ("2026-11-22T10:11:12.123456789+00:00", 1795342272.123456),
    ("2026-11-22T11:11:12+01:00", 1795342272.0),
])
def test_parse_notice_reads_absl_times(text, expected):
  assert preemption.parse_notice(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"ondemand_grace_seconds": -1}, "ondemand_grace_seconds"),
    ({"ondemand_grace_seconds": float("inf")}, "ondemand_grace_seconds"),
    ({"ondemand_grace_seconds": float("nan")}, "ondemand_grace_seconds"),
    ({"ondemand_grace_seconds": True}, "ondemand_grace_seconds"),
    ({"exit_after_ondemand_checkpoint": 1}, "exit_after_ondemand_checkpoint"),
])
def test_bad_preemption_options(kwargs, match):
  import orbax_mtc as mtc

  with pytest.raises((ValueError, TypeError), match=match):
    mtc.CheckpointManagerOptions(**kwargs)


def _manager(shm_dir, mesh, state, **options):
  import orbax_mtc as mtc

  opts = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=10),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=1000), **options)
  return mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                               abstract_of(state), options=opts)


def _composite(state):
  import orbax.checkpoint as ocp

  return ocp.args.Composite(state=ocp.args.PyTreeSave(state))


def test_sigterm_saves_on_demand_step_to_both_tiers(fresh_state, shm_dir, mesh):
  import orbax_mtc as mtc

  states = {step: make_state(mesh, seed=step) for step in (0, 3, 6, 9)}
  mgr = _manager(shm_dir, mesh, states[0])
  try:
    assert mgr.save(0, args=_composite(states[0]))  # interval and persistent step 0
    assert not mgr.save(3, args=_composite(states[3]))
    assert not mgr.should_exit()
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.reached_preemption(6)
    assert mgr.save(6, args=_composite(states[6]))  # 6 is no multiple of any interval
    assert mgr.should_exit()
    assert not mgr.save(6, args=_composite(states[6]))  # saved once
    assert not mgr.reached_preemption(9)
    record = mgr.last_ondemand
    assert isinstance(record, mtc.OnDemandSave) and record.step == 6 and record.persistent
    assert set(record.seconds) == {"agreement", "local", "peers", "persistent", "total"}
    assert record.seconds["total"] >= record.seconds["local"]
    assert 6 in committed_steps(mgr.local_directory) and 6 in sorted(ocp.utils.checkpoint_steps(mgr.directory))
    on_disk = json.loads((shm_dir / "local" / "6" / "ondemand.json").read_text())
    assert on_disk["step"] == 6 and on_disk["persistent"] is True
    assert mgr.metadata(6).custom_metadata["orbax_mtc_ondemand"]["step"] == 6
  finally:
    mgr.close()
  mgr = _manager(shm_dir, mesh, states[0])
  try:
    restored = mgr.restore(None)
    assert mgr.last_restore.step == 6 and mgr.last_restore.tier == "local"
    assert_trees_equal(restored.state, states[6])
  finally:
    mgr.close()


def test_exit_after_ondemand_checkpoint_raises_system_exit_0(fresh_state, shm_dir, mesh):
  state = make_state(mesh, seed=1)
  mgr = _manager(shm_dir, mesh, state, exit_after_ondemand_checkpoint=True)
  try:
    mgr.save(1, args=_composite(state))
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
      mgr.save(2, args=_composite(state))
    assert exited.value.code == 0
    # Closed: the RAM folder's lock is free for the next process.
    LocalDirectoryLock.claim(mgr.local_directory, job_name="next", process_index=0).release()
    assert 2 in committed_steps(mgr.local_directory) and 2 in sorted(ocp.utils.checkpoint_steps(mgr.directory))
  finally:
    mgr.close()  # a second close is a no-op
  assert signal.getsignal(signal.SIGTERM) is not fresh_state.recorder._on_sigterm


def test_zero_grace_skips_the_persistent_backup(fresh_state, shm_dir, mesh):
  state = make_state(mesh, seed=2)
  mgr = _manager(shm_dir, mesh, state, ondemand_grace_seconds=0)
  try:
    mgr.save(1, args=_composite(state))
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.save(2, args=_composite(state))
    assert mgr.last_ondemand.persistent is False
    assert 2 in committed_steps(mgr.local_directory) and 2 not in sorted(ocp.utils.checkpoint_steps(mgr.directory))
  finally:
    mgr.close()


def test_the_wait_for_a_backup_in_flight_counts_against_the_grace_budget(
    fresh_state, shm_dir, mesh, monkeypatch):
  """At the sync step a backup still in flight is waited for first; when that wait uses up
  the budget, no persistent backup of the on-demand step starts (RAM holds it)."""
  import time

  state = make_state(mesh, seed=4)
  budget = 1.0
  mgr = _manager(shm_dir, mesh, state, ondemand_grace_seconds=budget)
  original_poll = BackupScheduler.poll
  waited = []

  def slow_poll(self, *, block=False):
    if block and not waited:  # the first blocking wait: for the backup of step 0
      waited.append(True)
      time.sleep(1.5 * budget)  # it takes longer than the whole budget (elapsed time is the
      # subject here, not an ordering)
    original_poll(self, block=block)

  try:
    mgr.save(0, args=_composite(state))  # RAM; its backup starts at the next local save
    monkeypatch.setattr(BackupScheduler, "poll", slow_poll)
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.save(1, args=_composite(state))
    assert waited
    assert mgr.last_ondemand.step == 1 and mgr.last_ondemand.persistent is False
    assert 1 in committed_steps(mgr.local_directory) and sorted(ocp.utils.checkpoint_steps(mgr.directory)) == [0]
  finally:
    mgr.close()


def test_other_threads_only_read_answers(fresh_state, shm_dir, mesh):
  import threading

  state = make_state(mesh, seed=3)
  mgr = _manager(shm_dir, mesh, state)
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(mgr.reached_preemption(5)))
    worker.start()
    worker.join()
    assert seen == [False]  # no id was spent by the other thread ...
    assert mgr.reached_preemption(5) is True  # ... so the loop's next step is the sync step
  finally:
    mgr.close()
