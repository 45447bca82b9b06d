"""Replication's reduced agreements (orbax_mtc.peers.send_census): the status, the stream
sizes (narrow and wide) and the outcome give what the gathered rows gave. Pure."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_mtc import reduction
from orbax_mtc.agreement import Status
from orbax_mtc.peers import send_census
from orbax_mtc.reduction import Who

EDGES = [(0, 1), (1, 2), (2, 0), (0, 2)]


def reduce(contributions):
  return reduction.combine(contributions)


@pytest.mark.parametrize("states, failed, writing", [
    ([Status.COMMITTED] * 3, Who(0, -1), 0),
    ([Status.COMMITTED, Status.WRITING, Status.WRITING], Who(0, -1), 2),
    ([Status.WRITING, Status.FAILED, Status.FAILED], Who(2, 1), 1)])
def test_the_status_round_counts_and_names_the_lowest(states, failed, writing):
  votes = send_census.read_status(reduce(
      send_census.status(s, p, np.asarray([0, 10])) for p, s in enumerate(states)))
  assert (votes.failed, votes.writing, votes.wide) == (failed, writing, False)


@pytest.mark.parametrize("big", [5, 2 ** 31 - 1, 2 ** 31, 3 << 40])
def test_every_stream_size_is_its_senders_count(big):
  per_process = [np.asarray([n if src == p else 0 for n, (src, _) in
                             zip([big, 7, 0, 123], EDGES, strict=True)]) for p in range(3)]
  votes = send_census.read_status(reduce(
      send_census.status(Status.COMMITTED, p, per_process[p]) for p in range(3)))
  assert votes.wide is (big >= 2 ** 31)
  agreed = send_census.read_sizes(reduce(
      send_census.sizes(EDGES, p, per_process[p], votes.wide) for p in range(3)), EDGES,
      votes.wide)
  assert agreed.tolist() == [big, 7, 0, 123]
  # One int32 per stream, two when some stream is 2 GiB or more: nothing per process.
  assert send_census.sizes(EDGES, 0, per_process[0], votes.wide).nbytes == \
      4 * len(EDGES) * (2 if votes.wide else 1)


def test_the_outcome_names_the_lowest_failed_process_and_its_words():
  failures = [[], ["reading the stream to process 2: OSError"], ["placing a chunk"]]
  failed = send_census.read_outcome(reduce(
      send_census.outcome(bool(f), p) for p, f in enumerate(failures)))
  assert failed == Who(2, 1)
  words = send_census.read_message(reduce(
      send_census.message(f[0] if f else "", p, failed.lowest) for p, f in enumerate(failures)))
  assert words == "reading the stream to process 2: OSError"
