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
  assert (votes.failed, votes.writing, votes.bits) == (failed, writing, 4)


@pytest.mark.parametrize("big, per_stream", [
    (5, 4), (2 ** 31 - 1, 4), (2 ** 31, 5), (3 << 30, 5), (2 ** 39 - 1, 5), (2 ** 39, 8),
    (3 << 40, 8)])
def test_every_stream_size_is_its_senders_count(big, per_stream):
  per_process = [np.asarray([n if src == p else 0 for n, (src, _) in
                             zip([big, 7, 0, 123], EDGES, strict=True)]) for p in range(3)]
  votes = send_census.read_status(reduce(
      send_census.status(Status.COMMITTED, p, per_process[p]) for p in range(3)))
  assert votes.bits == max(big.bit_length(), 123 .bit_length())
  agreed = send_census.read_sizes(reduce(
      send_census.sizes(EDGES, p, per_process[p], votes.bits) for p in range(3)), EDGES,
      votes.bits)
  assert agreed.tolist() == [big, 7, 0, 123]
  # 4 bytes a stream, 5 past 2 GiB, 8 past 512 GiB: nothing per process.
  assert send_census.sizes(EDGES, 0, per_process[0], votes.bits).nbytes == \
      per_stream * len(EDGES)


def test_the_outcome_names_the_lowest_failed_process_and_its_words():
  failures = [[], ["reading the stream to process 2: OSError"], ["placing a chunk"]]
  failed = send_census.read_outcome(reduce(
      send_census.outcome(bool(f), p) for p, f in enumerate(failures)))
  assert failed == Who(2, 1)
  words = send_census.read_message(reduce(
      send_census.message(f[0] if f else "", p, failed.lowest) for p, f in enumerate(failures)))
  assert words == "reading the stream to process 2: OSError"


@pytest.mark.parametrize("big", [5, 2 ** 31, 3 << 40])
def test_few_streams_agree_their_sizes_in_the_status_round(big):
  """With at most MERGED_STREAMS streams, one round says who failed, who still writes and
  every stream's size (a writing process adds none yet)."""
  per_process = [np.asarray([n if src == p else 0 for n, (src, _) in
                             zip([big, 7, 0, 123], EDGES, strict=True)]) for p in range(3)]
  votes, agreed = send_census.read_status_with_sizes(reduce(
      send_census.status_with_sizes(Status.COMMITTED, p, EDGES, per_process[p])
      for p in range(3)))
  assert (votes.failed, votes.writing) == (Who(0, -1), 0)
  assert agreed.tolist() == [big, 7, 0, 123] and votes.bits == max(big, 123).bit_length()
  states = [Status.COMMITTED, Status.FAILED, Status.WRITING]
  votes, _ = send_census.read_status_with_sizes(reduce(
      send_census.status_with_sizes(s, p, EDGES, per_process[p]) for p, s in enumerate(states)))
  assert (votes.failed, votes.writing) == (Who(1, 1), 1)
  assert send_census.status_with_sizes(Status.WRITING, 0, EDGES, per_process[0]).nbytes == \
      4 * (2 + 2 * len(EDGES)) + 4
