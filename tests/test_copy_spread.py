"""A step's peer copies spread over several local intervals when the link lags them.

The copies' calls that waited for the link (the census's `copies_wait_ms`) widen the spread of
the next step's copies (peers/spread.py); the local saves in between carry the unissued
chunks on instead of sending their own step's, so no save waits for them; the step being sent
stays in RAM until its copies land or are dropped (rule 10).
"""

from __future__ import annotations

import shutil
import types

import mp_helpers
import pytest
from mp_helpers import assert_ok, mp_events, new_root, tail
from test_copy_rounds import rounds_per_call
from test_part_peer_copies import GRID_2X2, FakeAllreduce, FakeStore, FakeWriter, fake_mesh, make

import orbax_mtc as mtc
from orbax_mtc.agreement import Status
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import spread

# 16 MiB of shards per process in 1 MiB chunks, one replica (each node's copy goes whole to
# the other), every step's copies spread over 3 intervals of 4 steps: each step's 16 chunks
# go 2 a call, past the next local save (which carries them on).
SPREAD = ["--local-interval", "4", "--local-keep", "2", "--persistent-interval", "100",
          "--replicas", "1", "--rows", "65536", "--chunk-mib", "1", "--stretch", "3"]


def test_copies_spread_over_intervals_keep_their_step_and_carry_over_saves():
  """Once the copies' calls waited for the link (the census's `copies_wait_ms`), the next
  step's copies are spread over more intervals; a local save then carries the unissued ones
  on over the next interval instead of sending its own step's; the step being sent stays in
  RAM (`keep_sending`) until its copies land or are dropped."""
  # Process 0 of 4; the others still write, so no copy starts (each call: a status round).
  writer = FakeWriter()
  allreduce = FakeAllreduce(4, [Status.WRITING] * 4)
  local = types.SimpleNamespace(keep_sending=None, keep_replicated=None, steps=lambda: [7, 8])
  peers, _, _ = make(index=0, count=4, local=local, writer=writer, allreduce=allreduce,
                     store=FakeStore())
  peers.set_mesh(fake_mesh(GRID_2X2))
  peers.schedule(7, {})
  assert local.keep_sending == 7  # scheduled: read until its copies land
  peers.replicator._abort(peers.replicator._job)  # dropped: no longer read
  assert local.keep_sending is None and peers.pending_step is None
  peers.adapt(0, clock_ms=10_000)  # the first save: no interval to compare with yet
  assert peers.stretch == spread.Stretch(1, 0) and not peers.carries_on
  for _ in range(4):
    peers.progress(block=False)
  # The copies waited 300 ms of a 1 s interval: spread over twice as many calls.
  peers.adapt(300, clock_ms=11_000)
  assert peers.stretch == spread.Stretch(2, 0)
  peers.schedule(8, {})
  job = peers.replicator._job
  assert job.calls_between_saves == 8 and local.keep_sending == 8
  assert peers.carries_on  # chunks still to issue while the link lags: the next save carries
  for _ in range(4):
    peers.progress(block=False)  # a call each (a process still writes: a status round)
  rounds = len(allreduce.seen)
  peers.carry(9, {})  # the save moves them too: a call (a status round: still not started)
  assert peers.replicator._job is job and job.calls_between_saves == 8  # within its spread
  assert job.calls_seen == 5 and len(allreduce.seen) == rounds + 1
  for _ in range(4):
    peers.progress(block=False)
  peers.carry(10, {})  # past its spread: spread again over the next interval's calls (4)
  assert job.calls_between_saves == 13 and job.calls_seen == 10
  assert local.keep_sending == 8
  # With `max_spread_intervals=1` the spread never widens: every save sends its own copies.
  narrow, _, _ = make(mtc.CheckpointManagerOptions(
      replication=mtc.ReplicationOptions(max_spread_intervals=1)), index=0, count=4)
  narrow.adapt(0, clock_ms=0)
  narrow.adapt(900, clock_ms=1000)
  assert narrow.stretch == spread.Stretch(1, 0) and not narrow.carries_on


def test_finish_sends_the_newest_step_a_carrying_save_left_without_copies():
  """A save that carried an older step's copies sent none of its own step's: a wait
  (`finish`) sends them after the older ones, unless a later save's copies replaced them."""
  # Process 0 of 4; process 1 never has the steps, so each step's round drops it at once.
  writer = FakeWriter(Status.COMMITTED)
  allreduce = FakeAllreduce(4, [Status.COMMITTED, Status.FAILED, Status.COMMITTED,
                                Status.COMMITTED])
  peers, _, _ = make(index=0, count=4, writer=writer, allreduce=allreduce, store=FakeStore())
  peers.set_mesh(fake_mesh(GRID_2X2))
  peers.carry(8, {})  # step 8's save carried the copies of an older step
  peers.finish()
  assert writer.prepared == [8] and ("status_of", 8) in writer.calls
  assert peers.pending_step is None and writer.calls[-1] == ("drain",)
  peers.finish()  # sent (here: dropped, agreed) once, not again
  assert writer.prepared == [8]
  peers.carry(9, {})
  peers.schedule(10, {})  # a later save's own copies: step 9's are not needed any more
  peers.finish()
  assert writer.prepared == [8, 10] and ("status_of", 9) not in writer.calls


@pytest.mark.timeout(300)
def test_copies_spread_over_saves_land_whole_and_restore_a_lost_node(tmp_path):
  """Two real processes: the saves between a step's copies carry them on (the same rounds on
  both processes), no copy fails for its step's folder being retired meanwhile, and a node
  whose RAM is lost restores, bit for bit, the newest step: closing the manager sent its
  copies though its save carried an older step's."""
  root = new_root("copy-spread")
  persistent = tmp_path / "persistent"
  try:
    result, out = mp_helpers.run_job(
        ["save", "--steps", "26", "--persistent-dir", str(persistent), *SPREAD,
         "--report-copies", "--count-rounds"], 2, root, devices=1, timeout_s=180)
    assert_ok(result, out)
    calls = rounds_per_call(out.lines)
    assert calls[1] == calls[0], f"the processes made other rounds:\n{tail(out)}"
    text = out.text()
    assert "are dropped on every process" not in text and "is not replicated" not in text, \
        tail(out)
    saved = set(range(0, 26, 4))
    for node in (0, 1):
      held = {int(c.split(":")[1]) for n, f in mp_events.events(out.lines, "HELD") if n == node
              for c in f["copies"].split(",") if c != "-"}
      assert held <= saved, held
      # Some saves between copied steps sent none of their own: they carried them on.
      skipped = {s for s in saved if min(held) < s < max(held)} - held
      assert skipped, (sorted(held), tail(out))
    newest = {}
    for holder, source in ((0, 1), (1, 0)):
      store = peer_store.PeerStore(root / f"node{holder}", max_to_keep=None)
      steps = sorted(step for src, step in store.copies() if src == source)
      newest[source] = steps[-1]
      # The newest copy rebuilds the source's step (checksums hold), and both nodes still
      # hold that step in their own folder beside newer ones: a lost node restores it.
      manifest, _ = store.read(source, steps[-1], root / f"node{holder}" / str(steps[-1]))
      assert (manifest.step, manifest.process_index) == (steps[-1], source)
      assert steps[-1] in committed_steps(root / f"node{holder}"), steps
    # `close` waits for the copies: the newest step's too, though its save carried older ones.
    assert newest[0] == newest[1] == max(saved), (newest, tail(out))
    # Node 1's RAM is lost: the newest step the copies complete comes back, bit for bit.
    shutil.rmtree(root / "node1")
    (root / "node1").mkdir()
    result, out = mp_helpers.run_job(
        ["restore", "--persistent-dir", str(persistent), *SPREAD], 2, root, devices=1,
        timeout_s=180)
    assert_ok(result, out)
    results = mp_events.parse_results(out.lines)
    assert {n: (f["step"], f["tier"], f["ok"]) for n, f in results.items()} == {
        0: (str(newest[0]), "local", "1"), 1: (str(newest[0]), "peer", "1")}, tail(out)
    verify_step(root / "node1" / str(newest[0]))
  finally:
    shutil.rmtree(root, ignore_errors=True)
