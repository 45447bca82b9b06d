"""The RAM writer says whether its thread still has work (a continuous policy waits for it)."""

from __future__ import annotations

import threading

from orbax_mtc.local.store import LocalTier
from orbax_mtc.local.writer import RamWriter


def test_the_writer_is_busy_until_everything_handed_to_its_thread_has_run(tmp_path):
  writer = RamWriter(LocalTier(tmp_path / "local", max_to_keep=2), 0, 1, asynchronous=True,
                     on_error=lambda e: True)
  try:
    assert not writer.busy
    release, started = threading.Event(), threading.Event()

    def held() -> None:
      started.set()
      release.wait()

    first = writer.submit(held)
    # Work handed over directly (as peers/replication hands the read-ahead and the received
    # copies' commits to `executor`) counts too.
    second = writer.executor.submit(lambda: None)
    assert started.wait(30)
    assert writer.busy and not writer.writing
    release.set()
    first.result(timeout=30)
    second.result(timeout=30)
    assert not writer.busy
  finally:
    writer.shutdown()


def _writer(tmp_path) -> RamWriter:
  return RamWriter(LocalTier(tmp_path / "local", max_to_keep=2), 0, 1, asynchronous=True,
                   on_error=lambda e: True)


def test_within_first_the_step_write_goes_ahead_of_the_work_handed_over_meanwhile(tmp_path):
  writer = _writer(tmp_path)
  ran: list[str] = []
  gate = threading.Event()
  try:
    writer.executor.submit(gate.wait, 30)  # the thread is busy: the queue order shows
    with writer.first():
      chunk = writer.executor.submit(ran.append, "chunk")
      commit = writer.executor.submit(ran.append, "commit")
      cancelled = writer.executor.submit(ran.append, "cancelled")
      assert cancelled.cancel()  # as `Replicator._start` cancels a read not run yet
      assert writer.busy  # the held work and the gate still count (the newest was cancelled)
      write = writer.executor.submit_first(ran.append, "write")  # what RamWriter.write uses
    gate.set()
    for future in (chunk, commit, write):
      future.result(timeout=30)
    writer.drain()
    assert ran == ["write", "chunk", "commit"]
    assert not writer.busy
  finally:
    gate.set()
    writer.shutdown()


def test_waiting_on_held_work_lets_it_go_instead_of_deadlocking(tmp_path):
  writer = _writer(tmp_path)
  try:
    with writer.first():
      future = writer.executor.submit(lambda: 7)
      assert future.result(timeout=30) == 7  # released by the wait itself
      later = writer.executor.submit(lambda: 8)  # not held any more
      writer.drain()  # also releases (it would wait forever behind held work)
      assert later.done() and later.result() == 8
  finally:
    writer.shutdown()


def test_a_bounded_wait_returns_while_the_write_still_runs_and_keeps_it(tmp_path):
  """`wait(timeout_s)` (peer copies planned without a round wait so for the step's write):
  False while the write runs, the write still in flight; then True once it committed."""
  import numpy as np

  from orbax_mtc.agreement import Status
  from orbax_mtc.local.staging import stage

  tier = LocalTier(tmp_path / "local", max_to_keep=2)
  tier.prepare()
  writer = RamWriter(tier, 0, 1, asynchronous=True, on_error=lambda e: True)
  gate = threading.Event()
  try:
    writer.executor.submit(gate.wait, 30)  # the thread is busy: the write queues behind it
    writer.write(stage(5, {"state": {"w": np.arange(8.0)}}, {}, default_item=False))
    assert writer.wait(0.01) is False
    assert writer.writing and writer.status_of(5) == Status.WRITING
    gate.set()
    assert writer.wait(30) is True
    assert not writer.in_flight and writer.status_of(5) == Status.COMMITTED
    assert writer.wait(0.01) is True  # nothing in flight
  finally:
    gate.set()
    writer.shutdown()


def test_a_bounded_wait_hands_a_failed_write_to_the_next_agreement(tmp_path):
  errors: list[BaseException] = []
  writer = RamWriter(LocalTier(tmp_path / "local", max_to_keep=2), 0, 1, asynchronous=True,
                     on_error=lambda e: errors.append(e) or True)
  try:  # the tier was never prepared: the write fails on the thread
    import numpy as np

    from orbax_mtc.local.staging import stage

    writer.write(stage(5, {"state": {"w": np.arange(8.0)}}, {}, default_item=False))
    assert writer.wait(30) is True
    assert len(errors) == 1 and not writer.in_flight
  finally:
    writer.shutdown()
