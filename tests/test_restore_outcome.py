"""A restore attempt's outcome by reductions (restore/outcome.py) is the gathered records':
randomized outcomes, damaged tiles and failures included, and its size pinned."""

from __future__ import annotations

import random

import pytest

from orbax_mtc import reduction
from orbax_mtc.agreement import BuildRecord, Status
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
