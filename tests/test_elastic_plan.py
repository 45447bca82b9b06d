"""`elastic_plan`: reports, the choice of save and servers, and the byte ranges (pure).

Unit tests pin the documented behaviour; property tests generate saved layouts (grid tilings,
replica groups), inventories of folders on the current hosts (own folders and peer copies,
lost ranks, several steps and saves) and target tilings, and check the plan against brute
force: it reads only folders that exist, covers every tile, picks the newest coverable step
(None only when there is none), and every target shard is assembled from available ranks with
each element exactly once.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbax_mtc.restore import plan as elastic_plan
from orbax_mtc.restore.plan import (
    COPY,
    OWN,
    Box,
    Candidate,
    FolderRef,
    HostReport,
    TileIndex,
    choose_servers,
    covered,
    holder_sets,
    pieces,
    plan,
    provider,
    relative,
    volume,
)

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- reports


def _sorted(report: HostReport) -> tuple[list[FolderRef], list[FolderRef]]:
  return sorted(set(report.own)), sorted(set(report.copies))


def test_report_round_trip():
  report = HostReport(
      own=(FolderRef(7, 4, 3, 0xDEADBEEF), FolderRef(9, 4, 3, 0), FolderRef(9, 4, 0, 0)),
      copies=(FolderRef(7, 4, 2, 0xDEADBEEF), FolderRef(2**40, 100_000, 99_999, 0xFFFFFFFF),
              FolderRef(0, 1, 0, 1)))
  assert _sorted(HostReport.decode(report.encode())) == _sorted(report)
  assert HostReport.decode(HostReport().encode()) == HostReport()


@given(st.lists(st.tuples(st.sampled_from([OWN, COPY]), st.integers(0, 2**48),
                          st.integers(1, 2**20), st.integers(0, 2**32 - 1),
                          st.integers(0, 2**20)), max_size=30))
@settings(max_examples=200, deadline=None)
def test_report_round_trip_property(refs):
  own = tuple(FolderRef(s, c, r, d) for kind, s, c, d, r in refs if kind == OWN)
  copies = tuple(FolderRef(s, c, r, d) for kind, s, c, d, r in refs if kind == COPY)
  report = HostReport(own=own, copies=copies)
  assert _sorted(HostReport.decode(report.encode())) == _sorted(report)


def test_report_of_five_steps_with_a_copy_is_well_under_a_kibibyte():
  count, digest = 80_000, 0x9E3779B9
  steps = [1_000_000 + 100 * i for i in range(5)]
  report = HostReport(own=tuple(FolderRef(s, count, 79_998, digest) for s in steps),
                      copies=tuple(FolderRef(s, count, 79_999, digest) for s in steps))
  assert len(report.encode()) <= 256


@pytest.mark.parametrize("garbage", [
    b"\x80",  # a truncated varint
    b"\x01",  # one group announced, none there
    b"\x01\x07\x01\x01\x00\x00\x00\x00\x00",  # kind 7
    b"\x01\x00\x01\x02\x00\x00",  # a truncated digest
    b"\x01\x00\x01\x02\x00\x00\x00\x00\x03\x00",  # three ranks announced, one there
    HostReport(own=(FolderRef(1, 2, 1, 5),)).encode() + b"\x00",  # trailing bytes
    b"\xff" * 12,  # a varint longer than 64 bits
])
def test_decode_of_garbage_raises(garbage):
  with pytest.raises(ValueError):
    HostReport.decode(garbage)


def test_decode_reports_counts_an_unreadable_report_as_holding_nothing():
  import gc

  good = HostReport(own=(FolderRef(3, 2, 1, 9),))
  errors = []
  assert elastic_plan.decode_reports([good.encode(), b"\x80"],
                                     lambda p, e: errors.append(p)) == [good, HostReport()]
  assert errors == [1] and gc.isenabled()
  gc.disable()
  try:
    with elastic_plan.paused_gc():
      pass
    assert not gc.isenabled()  # left as the caller had it
  finally:
    gc.enable()


def test_negative_numbers_are_refused():
  with pytest.raises(ValueError):
    HostReport(own=(FolderRef(-1, 2, 0, 0),)).encode()


# ----------------------------------------------------------------------------- the plan

ALL = {(0,), (1,)}  # a layout of count 2, one replica: rank 0 holds tile 0, rank 1 tile 1


def _covers(sets_by_save: dict[tuple[int, int, int], set[tuple[int, ...]]]):
  return lambda c: covered(sets_by_save[(c.step, c.count, c.digest)], c.available)


def _own(step: int, count: int, rank: int, digest: int = 1) -> HostReport:
  return HostReport(own=(FolderRef(step, count, rank, digest),))


def test_plan_picks_the_newest_covered_step():
  reports = [
      HostReport(own=(FolderRef(1, 2, 0, 1), FolderRef(2, 2, 0, 1), FolderRef(3, 2, 0, 1))),
      HostReport(own=(FolderRef(1, 2, 1, 1), FolderRef(2, 2, 1, 1))),  # step 3's rank 1 lost
  ]
  covers = _covers({(s, 2, 1): ALL for s in (1, 2, 3)})
  chosen = plan(reports, covers)
  assert (chosen.step, chosen.count, chosen.digest) == (2, 2, 1)
  assert chosen.servers == ((0, 0, OWN), (1, 1, OWN))
  assert chosen.server_of() == {0: 0, 1: 1} and chosen.served_by(1) == {1: OWN}


def test_plan_never_mixes_saves():
  # Step 5 saved twice (two layouts): rank 0 of one and rank 1 of the other survive. Together
  # they would "cover" ranks {0, 1}, but no single save is complete: step 4 is restored.
  reports = [HostReport(own=(FolderRef(5, 2, 0, 11), FolderRef(4, 2, 0, 1))),
             HostReport(own=(FolderRef(5, 2, 1, 12), FolderRef(4, 2, 1, 1))),
             HostReport(copies=(FolderRef(5, 3, 2, 13),))]
  sets = {(5, 2, 11): ALL, (5, 2, 12): ALL, (4, 2, 1): ALL, (5, 3, 13): {(0,), (1,), (2,)}}
  found = elastic_plan.candidates(reports)
  assert [(c.step, c.count, c.digest, sorted(c.available)) for c in found] == [
      (5, 2, 11, [0]), (5, 2, 12, [1]), (5, 3, 13, [2]), (4, 2, 1, [0, 1])]
  chosen = plan(reports, _covers(sets))
  assert (chosen.step, chosen.digest) == (4, 1)
  # A save of the same step with another process count is another candidate too.
  reports.append(HostReport(own=(FolderRef(5, 3, 0, 13), FolderRef(5, 3, 1, 13))))
  chosen = plan(reports, _covers(sets))
  assert (chosen.step, chosen.count, chosen.digest) == (5, 3, 13)
  assert chosen.servers == ((0, 3, OWN), (1, 3, OWN), (2, 2, COPY))


def test_plan_respects_requested_step_min_step_and_excluded():
  reports = [HostReport(own=(FolderRef(1, 2, 0, 1), FolderRef(2, 2, 0, 1)),
                        copies=(FolderRef(2, 2, 1, 1),)),
             HostReport(own=(FolderRef(1, 2, 1, 1), FolderRef(2, 2, 1, 1)))]
  covers = _covers({(s, 2, 1): ALL for s in (1, 2)})
  assert plan(reports, covers).step == 2
  assert plan(reports, covers, requested_step=1).step == 1
  assert plan(reports, covers, requested_step=3) is None
  assert plan(reports, covers, min_step=2).step == 2
  assert plan(reports, covers, min_step=3) is None
  # Process 1's folder of rank 1, step 2, failed: process 0's copy serves it instead.
  chosen = plan(reports, covers, excluded={(1, 1, 2)})
  assert chosen.step == 2 and chosen.servers == ((0, 0, OWN), (1, 0, COPY))
  # Both holders of rank 1 at step 2 failed: step 1.
  assert plan(reports, covers, excluded={(1, 1, 2), (0, 1, 2)}).step == 1
  assert plan(reports, covers, excluded={(1, 1, 2), (0, 1, 2)}, min_step=2) is None


def test_candidates_ignore_ranks_outside_the_count():
  reports = [HostReport(own=(FolderRef(3, 2, 0, 1), FolderRef(3, 2, 2, 1)))]
  (only,) = elastic_plan.candidates(reports)
  assert only.available == frozenset({0})


def test_choose_servers_prefers_own_folders_and_spreads_copies():
  holders = {0: ((0, COPY), (1, OWN)),  # own wins over the lower process's copy
             1: ((0, COPY), (1, COPY)), 2: ((0, COPY), (1, COPY)),
             3: ((0, COPY), (1, COPY)), 4: ((0, COPY), (1, COPY)), 5: ((2, COPY),)}
  servers = choose_servers(Candidate(1, 6, 0, holders))
  assert servers[0] == (0, 1, OWN)
  assert [r for r, _, _ in servers] == [0, 1, 2, 3, 4, 5]
  copies = [p for r, p, kind in servers if kind == COPY and r in (1, 2, 3, 4)]
  load = {p: copies.count(p) + (p == 1) for p in (0, 1)}
  assert abs(load[0] - load[1]) <= 1, servers  # process 1 already serves rank 0
  assert servers[-1] == (5, 2, COPY)


def test_choose_servers_spreads_own_folders_held_twice():
  holders = {0: ((0, OWN), (1, OWN)), 1: ((0, OWN), (1, OWN))}
  assert choose_servers(Candidate(1, 2, 0, holders)) == ((0, 0, OWN), (1, 1, OWN))


def test_provider():
  # The receiver serves a holder itself: no transfer.
  assert provider((3, 7), receiver_ranks={7}, available={3, 7}, receiver=5) is None
  # Otherwise an available holder, spread over receivers.
  assert provider((3, 7), receiver_ranks={1}, available={3, 7}, receiver=0) == 3
  assert provider((3, 7), receiver_ranks={1}, available={3, 7}, receiver=1) == 7
  assert provider((3, 7), receiver_ranks=set(), available={7}, receiver=0) == 7
  assert provider((3, 7), receiver_ranks=set(), available={7}, receiver=1) == 7
  with pytest.raises(ValueError):
    provider((3, 7), receiver_ranks={1}, available={1, 2}, receiver=0)
  # A replicated tile (every rank holds it): the receiver's own ranks are looked up.
  everyone = tuple(range(100))
  assert provider(everyone, receiver_ranks={57}, available=set(everyone), receiver=9) is None
  assert provider(everyone, receiver_ranks={100, 101}, available=set(range(0, 100, 2)),
                  receiver=3) == 6


def test_holder_sets_are_per_set_not_per_tile():
  layout = [(((0, 2),), (0, 2)), (((2, 4),), (2, 0)), (((4, 6),), (1, 3))]
  assert holder_sets([layout, layout]) == {(0, 2), (1, 3)}
  assert covered({(0, 2), (1, 3)}, {2, 3}) and not covered({(0, 2), (1, 3)}, {0, 2})


# ----------------------------------------------------------------------------- tiles


def test_pieces_of_a_target_over_two_tiles():
  tiles = [((0, 2), (0, 4)), ((2, 4), (0, 4))]
  for given_tiles in (tiles, TileIndex(tiles)):
    assert pieces(((1, 3), (1, 2)), given_tiles) == [
        (0, ((1, 2), (1, 2))), (1, ((2, 3), (1, 2)))]
  assert relative(((2, 3), (1, 2)), ((1, 3), (1, 2))) == (slice(1, 2), slice(0, 1))


def test_pieces_count_identical_tiles_once_and_refuse_overlaps_and_gaps():
  tiles = [((0, 2),), ((0, 2),), ((2, 4),)]
  assert pieces(((0, 4),), tiles) == pieces(((0, 4),), TileIndex(tiles)) == [
      (0, ((0, 2),)), (2, ((2, 4),))]
  assert TileIndex(tiles).grid is not None
  assert TileIndex([((0, 1),), ((2, 4),)]).grid is not None  # a grid with a gap
  for bad in ([((0, 3),), ((2, 4),)], [((0, 1),), ((2, 4),)], [((0, 3),), ((1, 2),)]):
    for given_tiles in (bad, TileIndex(bad)):
      with pytest.raises(ValueError):
        pieces(((0, 4),), given_tiles)


def test_tile_index_falls_back_to_a_scan_for_a_partition_that_is_not_a_grid():
  # Rows split in two; the top band in two columns, the bottom band whole.
  tiles = [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 4))]
  index = TileIndex(tiles)
  assert index.grid is None and index == tuple(tiles)
  assert pieces(((1, 3), (1, 3)), index) == pieces(((1, 3), (1, 3)), tiles) == [
      (0, ((1, 2), (1, 2))), (1, ((1, 2), (2, 3))), (2, ((2, 3), (1, 3)))]


def test_pieces_of_a_scalar_and_of_an_empty_target():
  assert pieces((), [()]) == pieces((), TileIndex([()])) == [(0, ())]
  tiles = [((0, 2), (0, 0)), ((2, 4), (0, 0))]
  assert pieces(((0, 4), (0, 0)), tiles) == pieces(((0, 4), (0, 0)), TileIndex(tiles)) == []


# ----------------------------------------------------------------------------- generators


@st.composite
def _split(draw, size: int) -> list[tuple[int, int]]:
  """A split of range(size) into 1..4 consecutive parts."""
  parts = draw(st.integers(1, min(4, size)))
  cuts = sorted(draw(st.sets(st.integers(1, size - 1), min_size=parts - 1,
                             max_size=parts - 1))) if parts > 1 else []
  bounds = [0, *cuts, size]
  return list(zip(bounds[:-1], bounds[1:], strict=True))


@st.composite
def _tiling(draw, shape: tuple[int, ...]) -> list[Box]:
  """A grid tiling of an array of `shape`: a split of every dimension."""
  return [tuple(box) for box in itertools.product(*[draw(_split(n)) for n in shape])]


@dataclasses.dataclass
class _Save:
  step: int
  count: int
  digest: int
  tiles: list[list[Box]]  # per leaf
  holders: list[list[tuple[int, ...]]]  # per leaf, per tile

  @property
  def key(self) -> tuple[int, int, int]:
    return (self.step, self.count, self.digest)

  def sets(self) -> set[tuple[int, ...]]:
    return holder_sets([list(zip(t, h, strict=True))
                        for t, h in zip(self.tiles, self.holders, strict=True)])


@dataclasses.dataclass
class _Scenario:
  shapes: list[tuple[int, ...]]
  saves: list[_Save]
  processes: int
  held: list[tuple[int, int, int, int]]  # (save index, process, rank, OWN or COPY)
  excluded: set[tuple[int, int, int]]
  requested_step: int | None
  min_step: int | None
  targets: list[list[tuple[Box, set[int]]]]  # per leaf: (target shard, receiving processes)

  def reports(self) -> list[HostReport]:
    own: list[list[FolderRef]] = [[] for _ in range(self.processes)]
    copies: list[list[FolderRef]] = [[] for _ in range(self.processes)]
    for s, process, rank, kind in self.held:
      save = self.saves[s]
      ref = FolderRef(save.step, save.count, rank, save.digest)
      (own if kind == OWN else copies)[process].append(ref)
    return [HostReport(own=tuple(o), copies=tuple(c)) for o, c in zip(own, copies, strict=True)]

  def usable(self, s: int) -> set[tuple[int, int, int]]:
    """(process, rank, kind) of save `s` that exist and did not fail."""
    step = self.saves[s].step
    return {(p, r, k) for i, p, r, k in self.held
            if i == s and (p, r, step) not in self.excluded}

  def eligible(self, s: int) -> bool:
    step = self.saves[s].step
    return ((self.requested_step is None or step == self.requested_step)
            and (self.min_step is None or step >= self.min_step))

  def coverable(self, s: int) -> bool:
    """Brute force, tile by tile: every tile has a holder some process can still serve."""
    available = {r for _, r, _ in self.usable(s)}
    return all(any(h in available for h in holders)
               for leaf in self.saves[s].holders for holders in leaf)


@st.composite
def _scenarios(draw) -> _Scenario:
  shapes = draw(st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple),
                         min_size=1, max_size=3))
  saves: list[_Save] = []
  for digest in range(draw(st.integers(1, 4))):
    step = draw(st.integers(1, 5))
    replicas, group = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    tiles, holders = [], []
    for shape in shapes:
      leaf = draw(_tiling(shape))
      tiles.append(leaf)
      # Each tile: one holder in every replica group.
      holders.append([tuple(g * group + draw(st.integers(0, group - 1))
                            for g in range(replicas)) for _ in leaf])
    saves.append(_Save(step, replicas * group, 0x10000 + digest, tiles, holders))
  processes = draw(st.integers(1, 5))
  held = []
  for s, save in enumerate(saves):
    for rank in range(save.count):
      own = draw(st.none() | st.integers(0, processes - 1))
      if own is not None:
        held.append((s, own, rank, OWN))
      for p in sorted(draw(st.sets(st.integers(0, processes - 1), max_size=2))):
        held.append((s, p, rank, COPY))
  triples = sorted({(p, r, saves[s].step) for s, p, r, _ in held})
  excluded = draw(st.sets(st.sampled_from(triples), max_size=3)) if triples else set()
  requested = draw(st.none() | st.integers(1, 5))
  min_step = draw(st.none() | st.integers(1, 5))
  targets = []
  for shape in shapes:
    targets.append([(box, draw(st.sets(st.integers(0, processes - 1), min_size=1,
                                       max_size=2)))
                    for box in draw(_tiling(shape))])
  return _Scenario(shapes, saves, processes, held, set(excluded), requested, min_step, targets)


# ----------------------------------------------------------------------------- properties


@given(_scenarios())
@PROPERTY
def test_plan_matches_brute_force(sc: _Scenario):
  reports = [HostReport.decode(r.encode()) for r in sc.reports()]
  by_key = {save.key: (s, save) for s, save in enumerate(sc.saves)}
  sets = {save.key: save.sets() for save in sc.saves}
  chosen = plan(reports, _covers(sets), requested_step=sc.requested_step,
                min_step=sc.min_step, excluded=sc.excluded)
  coverable = [s for s in range(len(sc.saves)) if sc.eligible(s) and sc.coverable(s)]
  newest = max((sc.saves[s].step for s in coverable), default=None)
  if chosen is None:
    # (d) None only when no eligible save can be assembled.
    assert newest is None
    return
  # (c) The newest coverable step, and a save that is itself coverable.
  s, save = by_key[(chosen.step, chosen.count, chosen.digest)]
  assert chosen.step == newest and s in coverable
  # (a) One server per available rank, each holding that folder (reads only what exists),
  # and every tile of every leaf has an available holder.
  usable = sc.usable(s)
  assert [r for r, _, _ in chosen.servers] == sorted({r for _, r, _ in usable})
  for rank, process, kind in chosen.servers:
    assert (process, rank, kind) in usable
    if kind == COPY:  # a copy serves only when no process holds the rank's own folder
      assert not any(r == rank and k == OWN for _, r, k in usable)
  available = set(chosen.server_of())
  for leaf in save.holders:
    for holders in leaf:
      assert available.intersection(holders)
  # (b) Every target shard of every process: pieces from available ranks, each element once.
  served = {p: set(chosen.served_by(p)) for p in range(sc.processes)}
  assert set().union(*served.values()) == available
  for tiles, holders, targets in zip(save.tiles, save.holders, sc.targets, strict=True):
    index = TileIndex(tiles)
    assert index.grid is not None
    for box, receivers in targets:
      parts = pieces(box, tiles)
      assert pieces(box, index) == parts
      count = np.zeros([hi - lo for lo, hi in box], dtype=np.int32)
      for i, overlap in parts:
        assert elastic_plan.intersect(overlap, tiles[i]) == overlap
        count[relative(overlap, box)] += 1
      assert (count == 1).all()
      for receiver in receivers:
        for i, _ in parts:
          rank = provider(holders[i], served[receiver], available, receiver)
          if rank is None:
            assert served[receiver].intersection(holders[i])
          else:
            assert rank in holders[i] and rank in available


@given(st.lists(st.integers(1, 9), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(_tiling(tuple(shape)), _tiling(tuple(shape)),
                            st.randoms(use_true_random=False))))
@PROPERTY
def test_pieces_cover_every_element_once_in_tile_order(args):
  saved, target, rnd = args
  # Shuffled, with some tiles listed twice (replicas): the first listing gives the bytes.
  tiles = saved + rnd.sample(saved, rnd.randint(0, len(saved)))
  rnd.shuffle(tiles)
  index = TileIndex(tiles)
  assert index.grid is not None
  for box in target:
    parts = pieces(box, tiles)
    assert pieces(box, index) == parts
    assert [i for i, _ in parts] == sorted(i for i, _ in parts)
    assert all(tiles.index(tiles[i]) == i for i, _ in parts)
    count = np.zeros([hi - lo for lo, hi in box], dtype=np.int32)
    for i, overlap in parts:
      count[relative(overlap, box)] += 1
      assert elastic_plan.intersect(overlap, tiles[i]) == overlap
    assert (count == 1).all() and sum(volume(b) for _, b in parts) == volume(box)


@given(st.integers(2, 12).flatmap(lambda n: st.tuples(
    st.just(n), _split(n), _split(n), st.integers(0, n - 1), st.integers(1, n))))
@PROPERTY
def test_overlapping_or_gapped_tiles_raise_with_or_without_an_index(args):
  n, rows, cols, start, stop = args
  tiles = [(r, c) for r in rows for c in cols]
  extra = ((start, stop), (0, n))  # overlaps whatever lies in those rows
  if start >= stop or extra in tiles:
    return
  target = ((0, n), (0, n))
  for bad in (tiles + [extra], tiles[1:]):
    for given_tiles in (bad, TileIndex(bad)):
      with pytest.raises(ValueError):
        pieces(target, given_tiles)
