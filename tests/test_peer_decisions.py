"""The pure decisions behind the peer copies: which mesh axis holds the replicas, the copy
topology from plain numbers, and how many chunks a `save()` call issues."""

from __future__ import annotations

import numpy as np
import pytest

import orbax_mtc as mtc
from orbax_mtc import topology
from orbax_mtc.peers import spread


def test_replica_axis_name_single_versus_multi_process():
  options = mtc.CheckpointManagerOptions(replica_axis_index=None)
  assert topology.replica_axis_name(options, ("a", "b"), multi_process=False) == "a"
  assert topology.replica_axis_name(options, ("a", "data"), multi_process=True) == "data"
  with pytest.raises(ValueError, match="no axis named 'data'"):
    topology.replica_axis_name(options, ("a", "b"), multi_process=True)
  with pytest.raises(ValueError, match="out of range"):
    topology.replica_axis_name(mtc.CheckpointManagerOptions(replica_axis_index=2), ("a", "b"))


def test_topology_from_plain_numbers():
  grid = np.array([[0, 1], [2, 3]])
  topo = topology.build_topology(grid, ("data", "model"), "data", num_processes=4)
  assert topo.replica_of == (0, 0, 1, 1) and topo.position_of == (0, 1, 0, 1)
  assert topo.edges == ((0, 2), (1, 3), (2, 0), (3, 1))
  assert [topo.held_by(r) for r in range(4)] == [(2,), (3,), (0,), (1,)]
  single = topology.build_topology(np.array([[0]]), ("data", "model"), "data", num_processes=1)
  assert single.edges == () and single.peers == ((),)
  assert topology.build_topology(grid, ("data", "model"), "data", num_processes=4,
                                 peers_per_node=0).edges == ()



def test_chunks_per_call_spreads_what_is_left_over_the_calls_left():
  per_call = spread.chunks_per_call
  assert per_call(100, None, 1, 8) == 8  # no interval seen yet: the floor
  assert per_call(100, 1, 1, 8) == 100  # one call between local saves: all of it there
  # 20 calls before the next local save's: spread over all of them (the save agrees the
  # outcome of the last, which had a training step to arrive).
  assert per_call(100, 20, 1, 8) == 5
  assert per_call(100, 20, 5, 2) == 7  # a late start (a process still writing): more each
  assert per_call(10, 20, 1, 8, 2) == 2  # a small step: never below `least`
  assert per_call(101, 7, 1, 2) == 15  # rounded up: out within the interval
  assert per_call(100, 7, 6, 2) == 50
  assert per_call(100, 6, 6, 2) == 100  # the call before the save's: what is left
  assert per_call(100, 6, 7, 2) == 2  # past the estimate (the save may come any call): floor


def test_copies_that_waited_for_the_link_are_spread_wider_and_narrow_when_quiet():
  def step(stretch, waited_ms, interval_ms, most=8):
    return spread.next_stretch(stretch, waited_ms, interval_ms, most)
  one, Stretch = spread.Stretch(), spread.Stretch
  first = spread.QUIET_SAVES
  # Waits over 5 % of the interval between two local saves: twice as many intervals.
  assert step(one, 51, 1000) == Stretch(2, 0)
  assert step(Stretch(4, 3), 400, 1000) == Stretch(8, 0)
  assert step(Stretch(8, 0), 900, 1000) == Stretch(8, 0)  # at most `most` intervals
  assert step(Stretch(2, 0), 900, 1000, most=3) == Stretch(3, 0)
  # ...and over MIN_WAIT_MS: a few ms are scheduling noise, whatever the interval.
  assert step(one, spread.MIN_WAIT_MS, 100) == Stretch(1, 0)
  assert step(one, spread.MIN_WAIT_MS + 1, 100) == Stretch(2, 0)
  # Within the share: kept; a quiet save (waits under a quarter of it) counts towards
  # narrowing, a save with some waiting starts the count again.
  assert step(Stretch(2, 1, 8), 50, 1000) == Stretch(2, 0, 8)
  assert step(Stretch(2, 5, 8), 12, 1000) == Stretch(2, 6, 8)
  # `patience` quiet saves in a row: one interval narrower, never under one; the narrowed
  # step's intervals and the save after them probe it.
  assert step(Stretch(4, first - 1), 0, 1000) == Stretch(3, 0, first, probing=4)
  assert step(Stretch(2, 7, 8), 0, 1000) == Stretch(1, 0, 8, probing=2)
  assert step(Stretch(1, 7, 8), 0, 1000) == Stretch(1, 8, 8)
  # Waits during the probe: the narrowing was one too many; back to the spread that bore
  # the copies (not twice the narrowed one), and twice the quiet saves before the next try
  # (at most MOST_QUIET_SAVES)...
  assert step(Stretch(1, 0, 8, probing=1), 300, 1000) == Stretch(2, 0, 16)
  assert step(Stretch(3, 1, 4, probing=3), 300, 1000) == Stretch(4, 0, 8)
  most_quiet = spread.MOST_QUIET_SAVES
  assert step(Stretch(1, 0, most_quiet, probing=2), 300, 1000) == Stretch(2, 0, most_quiet)
  # ...while a probe that passes halves them (at least QUIET_SAVES), and waits after it
  # only widen.
  assert step(Stretch(1, 0, 8, probing=1), 0, 1000) == Stretch(1, 1, 4)
  assert step(Stretch(1, 0, first, probing=1), 0, 1000) == Stretch(1, 1, first)
  assert step(Stretch(1, 3, 8), 300, 1000) == Stretch(2, 0, 8)
  # A link that needs two intervals (waits whenever a step's copies had one): probes of one
  # interval ever further apart, then one every MOST_QUIET_SAVES + 1 saves.
  stretch, seen = one, []
  for _ in range(60):
    stretch = step(stretch, 300 if stretch.intervals == 1 else 0, 1000)
    seen.append(stretch.intervals)
  assert max(seen) == 2 and [i for i, n in enumerate(seen) if n == 1] == [2, 7, 16, 33, 50]
  # No interval measured (the first save, a clock that went back): as it was.
  assert step(Stretch(2, 1), 500, 0) == Stretch(2, 1)
  assert step(Stretch(2, 1), 500, -30) == Stretch(2, 1)
  # `max_spread_intervals=1`: every step's copies within one interval, whatever waited.
  assert step(one, 900, 1000, most=1) == one and step(Stretch(1, 3), 0, 1000, most=1) == \
      Stretch(1, 4)


def test_a_stretched_spread_covers_the_calls_of_its_intervals():
  assert spread.budget(None, spread.Stretch(4)) is None  # no interval seen yet
  assert spread.budget(19, spread.Stretch()) == 19
  # The local saves between issue none of its chunks: 4 + 4 calls at 5 steps an interval.
  assert spread.budget(4, spread.Stretch(2)) == 8


def test_copies_start_a_call_after_a_write_that_outlasted_the_first():
  assert [spread.start_call(ready, 20) for ready in (0, 1, 2, 3, 7)] == [1, 1, 3, 4, 8]
  # Unless no call would be left before the next local save (the write nearly fills it).
  assert [spread.start_call(ready, 5) for ready in (2, 3, 4, 5)] == [3, 4, 4, 5]
