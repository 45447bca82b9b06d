"""Copies planned with the last agreed sizes (peers/size_plan.py): the pure parts, and the
replicator taking no round for them (the fakes of test_part_peer_copies; the real transfer,
a stream that outgrew its plan included, runs in tests/test_consistency.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_part_peer_copies import committed_ring

import orbax_mtc as mtc
from orbax_mtc import reduction
from orbax_mtc.agreement import Status
from orbax_mtc.peers import size_plan


@pytest.mark.parametrize("nbytes", [1, 2638, 4096, 256 << 20, (1 << 30) + 12345])
def test_a_stream_is_planned_with_room_to_grow_in_whole_pages(nbytes):
  planned = size_plan.padded(nbytes)
  assert planned % 4096 == 0
  assert planned - nbytes >= (64 << 10) + nbytes // 4096
  assert planned - nbytes < (64 << 10) + nbytes // 4096 + 4096


def test_an_empty_stream_stays_empty():
  assert size_plan.padded(0) == 0  # a receiver that holds every shard: no header either


def test_the_plan_covers_only_edges_it_learned_and_forgets_them_all():
  plan = size_plan.SizePlan()
  assert not plan.covers([(0, 1)]) and not plan.covers([])
  plan.learn([(0, 1), (1, 0)], np.asarray([100, 0]))
  assert plan.covers([(0, 1), (1, 0)]) and plan.covers([(1, 0)])
  assert not plan.covers([(0, 1), (2, 3)])
  assert plan.planned([(1, 0), (0, 1)]) == [0, size_plan.padded(100)]
  plan.learn([(0, 1)], [5000])  # a later round replaces what it agreed again
  assert plan.planned([(0, 1)]) == [size_plan.padded(5000)]
  plan.forget()
  assert not plan.covers([(1, 0)])


def test_a_stream_past_its_plan_is_named_with_both_sizes():
  assert size_plan.outgrown({1: 10, 2: 20}, {1: 10, 2: 30}) == []
  (why,) = size_plan.outgrown({1: 11, 2: 20}, {1: 10, 2: 30})
  assert "process 1" in why and "11 bytes" in why and "10 planned" in why


def test_a_stream_shorter_than_its_plan_is_read_then_zeros():
  data = np.arange(1, 101, dtype=np.uint8)

  def read(offset, out):
    assert offset + out.nbytes <= data.nbytes, "read past the stream's end"
    out[:] = data[offset:offset + out.nbytes]

  reader = size_plan.padded_reader(read, data.nbytes)
  out = np.full(64, 7, np.uint8)
  reader(64, out)  # 36 bytes of the stream, then its padding
  assert out[:36].tolist() == data[64:].tolist() and not out[36:].any()
  out[:] = 7
  reader(128, out)  # wholly past the end: never read
  assert not out.any()
  out[:] = 7
  size_plan.zeros(0, out)
  assert not out.any()


def sized_ring():
  """`committed_ring` whose first step's copies (step 4) went out through the round, their
  sizes learned: (peers, writer, allreduce)."""
  peers, writer, _, allreduce = committed_ring()
  peers.schedule(4, {})
  peers.issue()
  peers.settle()
  return peers, writer, allreduce


def test_the_next_steps_copies_start_without_a_round_after_each_waits_for_its_write():
  peers, writer, _, allreduce = committed_ring()
  replicator = peers.replicator
  peers.schedule(4, {})
  assert not replicator.starts_without_round  # the first step: the round sizes it
  peers.issue()
  assert len(allreduce.seen) == 1  # the status round, with the sizes
  peers.settle()
  assert replicator.finished_steps == 1
  rounds = len(allreduce.seen)
  peers.schedule(6, {})
  assert replicator.starts_without_round
  writer.calls.clear()
  peers.progress(block=False)
  timeout = mtc.CheckpointManagerOptions().agreement_timeout_seconds  # the default
  assert writer.calls[:2] == [("wait", timeout), ("status_of", 6)]
  assert len(allreduce.seen) == rounds  # no round: planned with the sizes step 4 agreed
  assert replicator.unissued_step is None and replicator.pending_step == 6
  assert peers.retire_landing() is False
  peers.settle(reduction.Who())  # the census agreed nothing failed: no round either
  assert len(allreduce.seen) == rounds and replicator.finished_steps == 2


def test_after_a_step_whose_copies_failed_the_next_takes_the_round_again():
  peers, writer, allreduce = sized_ring()
  replicator = peers.replicator
  peers.schedule(6, {})
  peers.issue()  # planned: no round
  rounds = len(allreduce.seen)
  peers.settle(reduction.Who(1, 2))  # process 2's part failed (the failed one's words: a round)
  assert replicator.failed_steps == 1 and len(allreduce.seen) == rounds + 1
  peers.schedule(8, {})
  assert not replicator.starts_without_round
  writer.calls.clear()
  peers.progress(block=False)
  assert ("wait",) not in writer.calls and len(allreduce.seen) == rounds + 2  # the round
  assert replicator.unissued_step is None


def test_a_process_whose_write_outlasted_the_wait_fails_the_step_after_the_transfer():
  """No round asked whether every node committed: the one still writing (its bounded wait
  ran out) takes part, records the failure, and the outcome drops the step's copies
  everywhere (here the census's answer, which carries it)."""
  peers, writer, allreduce = sized_ring()
  replicator = peers.replicator
  peers.schedule(6, {})
  writer.status = Status.WRITING
  rounds = len(allreduce.seen)
  peers.progress(block=False)
  assert len(allreduce.seen) == rounds and replicator.unissued_step is None
  assert peers.retire_landing() is True  # failed here: the census says so to every process
  peers.settle(reduction.Who(1, 0))
  assert replicator.failed_steps == 1 and replicator.landed_step == 4
  peers.schedule(8, {})
  assert not replicator.starts_without_round  # the round again


def test_the_first_call_that_finds_the_write_done_is_reported_for_the_next_save():
  peers, writer, _, _ = committed_ring()
  assert peers.ready_call == 1  # no call yet: the next one
  peers.schedule(4, {})
  writer.writing = True  # step 4's write runs through two calls
  peers.progress(block=False)
  peers.progress(block=False)
  assert peers.ready_call == 3  # none found it done yet
  writer.writing = False
  peers.progress(block=False)
  peers.progress(block=False)
  assert peers.ready_call == 3  # the first that did
  peers.schedule(6, {}, start_call=3)
  assert peers.ready_call == 1  # counted again from this save


def test_planned_copies_start_at_the_call_the_census_named_without_waiting_before():
  peers, writer, allreduce = sized_ring()
  replicator = peers.replicator
  rounds = len(allreduce.seen)
  peers.schedule(6, {}, start_call=3)
  writer.calls.clear()
  for _ in range(2):  # calls 1 and 2: nothing moves, nobody waits, no round
    assert not replicator.starts_without_round
    peers.progress(block=False)
    assert replicator.unissued_step == 6
  assert not any(call[0] == "wait" for call in writer.calls)
  assert replicator.starts_without_round
  peers.progress(block=False)  # call 3: each waits for its own write, then sends
  timeout = mtc.CheckpointManagerOptions().agreement_timeout_seconds
  assert ("wait", timeout) in writer.calls and replicator.unissued_step is None
  assert len(allreduce.seen) == rounds


def test_a_call_that_moves_nothing_leaves_the_landed_steps_outcome_to_the_census():
  """Copies issued at a local save land meanwhile; a call with nothing to start or move
  makes no round for their outcome: the next save's census carries it."""
  peers, _, _, allreduce = committed_ring()
  replicator = peers.replicator
  peers.schedule(4, {})
  peers.issue()  # at the save: every chunk issued, the step landing
  rounds = len(allreduce.seen)
  peers.progress(block=False)  # nothing else pending
  assert len(allreduce.seen) == rounds and replicator.pending_step == 4
  assert peers.retire_landing() is False
  peers.settle(reduction.Who())  # the census's answer
  assert len(allreduce.seen) == rounds and replicator.finished_steps == 1
