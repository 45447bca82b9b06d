"""A restore attempt's outcome by reductions (restore/outcome.py) is the gathered records':
randomized outcomes, damaged tiles and failures included, and its size pinned."""

from __future__ import annotations

import random

import pytest

from orbax_mtc import reduction, topology
from orbax_mtc.agreement import BuildRecord, ServeRecord, Status
from orbax_mtc.peers import exchange
from orbax_mtc.restore import outcome


def _reduced(records, server_of, count):
  rounds = []

  def reduce(rnd):
    rounds.append(reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records)))
    return rounds[-1]
  return outcome.agree(records[0], 0, len(records), server_of, count, reduce), rounds


@pytest.mark.parametrize("seed", range(200))
def test_the_reductions_give_the_gathered_outcome(seed):
  rng = random.Random(seed)
  processes, count = rng.randint(1, 40), rng.randint(1, 40)
  server_of = {r: rng.randrange(processes) for r in range(count) if rng.random() < 0.9}
  records = []
  for _ in range(processes):
    status = rng.choice([Status.OK] * 6 + [Status.UNUSABLE, Status.FAILED, Status.MISMATCH])
    bad = status == Status.UNUSABLE and server_of and rng.random() < 0.7
    rank = rng.choice(sorted(server_of)) if bad else -1
    records.append(BuildRecord(
        status=status, bad_process=server_of[rank] if bad else -1, bad_rank=rank,
        moved=rng.random() < 0.2, in_place=rng.random() < 0.5,
        message=f"{status.name} {rng.random()}" if status != Status.OK else ""))
  new, _ = _reduced(records, server_of, count)
  old = outcome.of_records(records)
  assert (new.counts, new.said, new.moved, new.not_in_place, new.bad, new.ok) == (
      old.counts, old.said, old.moved, old.not_in_place, old.bad, old.ok)
  lowest_failed = dict(sorted(old.failed.items())[:1])
  assert new.failed == lowest_failed


@pytest.mark.parametrize("processes", [2, 100, 100_000])
def test_bytes_per_process_as_a_function_of_the_process_count(processes):
  # A good outcome: one round of 4 x (22 + P / 32) bytes, about 25 KiB at 100,000 processes.
  records = [BuildRecord(in_place=True)] * min(processes, 3)
  vector = outcome.statuses(records[0], 0, processes).nbytes
  assert vector == 4 * (2 * len(Status) + 2 + reduction.bitmap_words(processes))
  assert outcome.outcome_bytes(processes) == reduction.received_bytes(vector, processes)
  assert outcome.outcome_bytes(100_000, count=100_000, spoken=2) < 300_000
  if processes <= 100:
    records = [BuildRecord(in_place=True) for _ in range(processes)]
    agreed, rounds = _reduced(records, {}, 0)
    assert agreed.ok and agreed.not_in_place == () and len(rounds) == 1


def _simulate(serves, sends_of, server_of, count):
  """Every process's contributions, for whichever record a round carries."""
  rounds = []

  def reduce(rnd):
    if isinstance(rnd.record, BuildRecord):
      records = [s.early for s in serves]
    elif isinstance(rnd.record, dict):
      records = sends_of
    elif isinstance(rnd.record, tuple):
      records = list(zip(serves, sends_of, strict=True))
    else:
      records = serves
    rounds.append(reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records)))
    return rounds[-1]
  return reduce, rounds


@pytest.mark.parametrize("seed", range(200))
def test_the_exchange_agrees_the_gathered_status_and_every_stream(seed):
  rng = random.Random(seed)
  processes, count = rng.randint(1, 12), rng.randint(1, 12)
  server_of = {r: rng.randrange(processes) for r in range(count)}
  failing = rng.random() < 0.3
  serves, sends_of = [], []
  for p in range(processes):
    status = rng.choice([Status.OK] * 4 + [Status.UNUSABLE, Status.LACKING, Status.FAILED,
                                           Status.MISMATCH]) if failing else Status.OK
    mine = [r for r, s in server_of.items() if s == p]
    ranks = tuple(rng.sample(mine, min(len(mine), 2))) if status in (
        Status.UNUSABLE, Status.LACKING) else ()
    early = BuildRecord(status=rng.choice([Status.OK, Status.OK, Status.NONE, Status.UNUSABLE]),
                        in_place=rng.random() < 0.5, message="early")
    serves.append(ServeRecord(status=status, failed_ranks=ranks,
                              message="" if status == Status.OK else f"{status.name} {p}",
                              early=early))
    wide = rng.choice([1 << 10, 1 << 33, 1 << 45])
    sends_of.append({d: rng.randrange(wide) for d in range(processes)
                     if d != p and rng.random() < 0.3})
  reduce, rounds = _simulate(serves, sends_of, server_of, count)
  served = outcome.agree_serve(serves[0], 0, processes, server_of, count, sends_of[0], reduce)
  old = outcome.of_records(serves)
  assert (served.serving.ok, served.serving.counts) == (old.ok, old.counts)
  if not old.ok:
    assert (served.serving.said, served.serving.bad, served.serving.lacking) == (
        old.said, old.bad, old.lacking)
    return
  expected = sorted((p, d, n) for p, s in enumerate(sends_of) for d, n in s.items() if n > 0)
  assert served.streams == len(expected)
  if served.streams:
    assert served.early is None
    assert served.most == max(len([n for n in s.values() if n > 0]) for s in sends_of)
    edges = sorted((p, d) for p, d, _ in expected)
    size = {(p, d): n for p, d, n in expected}
    for me in sorted({0, processes - 1, rng.randrange(processes)}):
      for most in (served.most, 300):  # a wider count field than needed agrees the same
        before = len(rounds)
        plan = exchange.agree_streams(sends_of[me], me, processes, served.streams,
                                      served.bits, most, reduce)
        assert sorted((s.source, s.destination) for s in plan.streams) == edges
        assert plan.rounds == topology.transfer_rounds(edges)
        unit = 1 << max(12, served.bits + 1 - 30)
        for round_edges in plan.rounds:
          bound = max(-(-(size[e] + exchange.FRAME) // unit) * unit for e in round_edges)
          for s in (s for s in plan.streams if (s.source, s.destination) in round_edges):
            framed = size[(s.source, s.destination)] + exchange.FRAME
            # Its own streams at their size, the others' at the round's largest.
            assert s.nbytes == (framed if s.source == me else bound)
        if most == served.most:
          # The rounds' sizes are the formula's: status, counts, destinations, largest.
          sizes = [r.nbytes for r in rounds[:1] + rounds[before:before + 3]]
          assert sum(reduction.received_bytes(v, processes) for v in sizes) == \
              outcome.exchange_bytes(processes, served.streams, served.most,
                                     len(plan.rounds))
  elif any(s.early.status == Status.NONE for s in serves):
    assert served.early is None
  else:
    early = outcome.of_records([s.early for s in serves])
    assert (served.early.counts, served.early.said, served.early.not_in_place) == (
        early.counts, early.said, early.not_in_place)
