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
