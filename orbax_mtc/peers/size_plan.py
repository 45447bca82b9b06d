"""The copy streams' sizes a step is planned with when no round agrees them (pure).

A step's copies are planned from every stream's byte count, known alike on every process.
The first step's counts are agreed in the status round (send_census), which also waits until
every node has committed the step. A training loop saves the same tree every time, so the
next step's streams have the same shards and a header that differs by a few digits (its
checksums, its step): it is planned with the last agreed counts, each padded by `margin`,
and no round at all, at the call by which every node's previous write was done (the save's
census says which: peers/copies.PeerCopies.ready_call), where each process waits for its own
write. Each sender then checks its real streams against the plan: one that outgrew it (a
bigger tree, a longer per-process item) is not sent, and the failure is agreed after the
transfer like any other (rule 9), after which the next step takes the round again and
learns the new counts. A stream shorter than its plan is sent with zeros after its end;
the receiver's header says where the copy's shards lie.

No I/O, no collectives: the replicator (peers/replication.py) keeps one `SizePlan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from orbax_mtc import transport

Edge = tuple[int, int]  # (sender, receiver)
_PAGE = 4096


def margin(nbytes: int) -> int:
  """Room left for a stream to grow past its agreed count: 64 KiB plus 1/4096 of it (the
  header's manifest grows with the shards' count, the data does not)."""
  return (64 << 10) + nbytes // 4096


def padded(nbytes: int) -> int:
  """The planned count of a stream whose last agreed count is `nbytes` (0 stays 0: an empty
  stream, a receiver that holds every shard itself, has no header either)."""
  if nbytes <= 0:
    return 0
  return -(-(nbytes + margin(nbytes)) // _PAGE) * _PAGE


class SizePlan:
  """The padded counts of the last agreed plan, per edge (the same on every process)."""

  def __init__(self) -> None:
    self._planned: dict[Edge, int] = {}

  def covers(self, edges: Sequence[Edge]) -> bool:
    """Whether a step on `edges` can be planned without a round."""
    return bool(edges) and all(edge in self._planned for edge in edges)

  def learn(self, edges: Sequence[Edge], agreed: Sequence[int]) -> None:
    """Keeps the counts a round agreed (padded) for the next steps."""
    self._planned.update({tuple(edge): padded(int(n))
                          for edge, n in zip(edges, agreed, strict=True)})

  def forget(self) -> None:
    """After a step whose copies failed anywhere: the next one takes the round again."""
    self._planned.clear()

  def planned(self, edges: Sequence[Edge]) -> list[int]:
    """The counts to plan `edges` with (`covers` first)."""
    return [self._planned[tuple(edge)] for edge in edges]


def outgrown(actual: Mapping[int, int], planned: Mapping[int, int]) -> list[str]:
  """Why this sender's streams do not fit the plan: per receiver, its real count against
  the planned one (both keyed by receiver)."""
  return [f"the copy for process {receiver} is {n} bytes, past the {planned[receiver]} "
          "planned from the previous step's (this step's copies are dropped; the next "
          "step's are sized again)"
          for receiver, n in sorted(actual.items()) if n > planned[receiver]]


def padded_reader(read: transport.Reader, nbytes: int) -> transport.Reader:
  """A reader of a stream of `nbytes` that is planned longer: zeros after its end."""

  def reader(offset: int, out: np.ndarray) -> None:
    stop = max(0, min(out.nbytes, nbytes - offset))
    if stop:
      read(offset, out[:stop])
    out[stop:] = 0
  return reader


def zeros(offset: int, out: np.ndarray) -> None:
  """The reader of a stream that is not sent (its failure is agreed after the transfer)."""
  del offset
  out[:] = 0
