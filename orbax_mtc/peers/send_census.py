"""Replication's agreements as reductions (pure): what each process adds, and the answer.

The copies of a step move once every node has committed it. Where no earlier plan sizes
them (the first step, after a step whose copies failed: peers/size_plan.py), each `save()`
call asks, while some node still writes, whether all have: one **status** round of a few
counts (the processes that failed, those still writing, the lowest failed one, the widest
stream size), the same size at any process count. Once all have, one **sizes** round agrees
every copy stream's byte count, which the transfer's plan needs on every process: each
stream's sender adds its count in the stream's slot and the others add 0, so the sum (or
max) is the count: one int32 per stream (4 bytes); past 2 GiB its low 31 bits and a uint8 of
the bits above (5 bytes, to 512 GiB a stream); beyond, two 31-bit halves (8 bytes). Up to
`MERGED_STREAMS` streams the sizes travel in the status round itself (`status_with_sizes`:
8 bytes a stream, 4 KiB at most), one round less per step where a round costs more than its
bytes. After the transfer, an **outcome** round counts the processes whose chunks failed and
names the lowest, whose message follows in one more round only then (or the next save's
census carries it).

No I/O and no JAX: the collective is passed in (peers/replication.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from orbax_mtc import reduction, row_codec
from orbax_mtc.agreement import Status
from orbax_mtc.reduction import LOW, Parts, Who

_NARROW = 31  # sizes of at most 31 bits travel as one int32
_MEDIUM = 39  # up to 39 bits: 31 in an int32, 8 in a uint8 (maxed: only the sender adds one)
_MESSAGE = row_codec.Text(1200)
# Up to this many copy streams, their sizes ride in the status round (two 31-bit halves each:
# 4 KiB at most); past it, the status round stays a few counts at any process count.
MERGED_STREAMS = 512


@dataclasses.dataclass(frozen=True)
class Votes:
  """The status round's answer.

  Attributes:
    failed: The processes that could not commit (or read) the step.
    writing: How many processes still write it.
    bits: The widest stream size's bit length (how the sizes travel).
  """

  failed: Who
  writing: int
  bits: int


def status(state: Status, me: int, sizes: np.ndarray) -> Parts:
  """This process's status: its state and the widest stream it sends."""
  parts = Parts.empty(2, 2)
  parts.add[:] = [state == Status.FAILED, state == Status.WRITING]
  if state == Status.FAILED:
    parts.top[0] = -me
  parts.top[1] = max((int(n).bit_length() for n in np.asarray(sizes).reshape(-1)), default=0)
  return parts


def read_status(reduced: Parts) -> Votes:
  """The answer of a reduced status round."""
  failed = int(reduced.add[0])
  return Votes(Who(failed, int(-reduced.top[0]) if failed else -1), int(reduced.add[1]),
               int(reduced.top[1]))


def status_with_sizes(state: Status, me: int, edges: Sequence[tuple[int, int]],
                      outgoing: np.ndarray) -> Parts:
  """The status round with every stream's size in it (for at most `MERGED_STREAMS`
  streams): this process's state, and its streams' counts once it has committed."""
  parts = Parts.empty(2 + 2 * len(edges), 1)
  parts.add[:2] = [state == Status.FAILED, state == Status.WRITING]
  if state == Status.FAILED:
    parts.top[0] = -me
  if state == Status.COMMITTED:
    for j, (source, _) in enumerate(edges):
      if source == me:
        parts.add[2 + 2 * j:4 + 2 * j] = reduction.split(int(outgoing[j]))
  return parts


def read_status_with_sizes(reduced: Parts) -> tuple[Votes, np.ndarray]:
  """The answer of a reduced `status_with_sizes` round: the votes, and every stream's byte
  count (int64, in the order of the edges; meaningful once no process writes or failed)."""
  failed = int(reduced.add[0])
  pairs = reduced.add[2:].astype(np.int64).reshape(-1, 2)
  counts = np.asarray([reduction.join(high, low) for high, low in pairs], dtype=np.int64)
  bits = max((int(n).bit_length() for n in counts), default=0)
  return Votes(Who(failed, int(-reduced.top[0]) if failed else -1), int(reduced.add[1]),
               bits), counts


def sizes(edges: Sequence[tuple[int, int]], me: int, outgoing: np.ndarray, bits: int) -> Parts:
  """Per stream, its byte count where this process sends it (0 elsewhere); `bits` is the
  agreed widest size's bit length."""
  low_mask = (1 << _NARROW) - 1
  if bits <= _MEDIUM:
    parts = Parts.empty(len(edges), 0, len(edges) if bits > _NARROW else 0)
    for j, (source, _) in enumerate(edges):
      if source == me:
        n = int(outgoing[j])
        parts.add[j] = n & low_mask
        if parts.flags.size:
          parts.flags[j] = n >> _NARROW
    return parts
  parts = Parts.empty(2 * len(edges), 0)
  for j, (source, _) in enumerate(edges):
    if source == me:
      parts.add[2 * j:2 * j + 2] = reduction.split(int(outgoing[j]))
  return parts


def read_sizes(reduced: Parts, edges: Sequence[tuple[int, int]], bits: int) -> np.ndarray:
  """Every stream's agreed byte count (int64, in the order of `edges`)."""
  values = reduced.add.astype(np.int64)
  if bits <= _MEDIUM:
    if reduced.flags.size:
      values = values | (reduced.flags.astype(np.int64) << _NARROW)
    return values
  pairs = values.reshape(len(edges), 2)
  return np.asarray([reduction.join(h, lo) for h, lo in pairs], dtype=np.int64)


def outcome(failed: bool, me: int) -> Parts:
  """Whether this process's part of a transfer failed."""
  parts = Parts.empty(1, 1)
  parts.add[0] = int(failed)
  parts.top[0] = -me if failed else LOW
  return parts


def read_outcome(reduced: Parts) -> Who:
  """The processes whose part of the transfer failed."""
  count = int(reduced.add[0])
  return Who(count, int(-reduced.top[0]) if count else -1)


def message(text: str, me: int, speaker: int) -> Parts:
  """`text` in the one slot `speaker` fills (the others add zeros)."""
  parts = Parts.empty(2 * _MESSAGE.size, 0)
  if me == speaker:
    parts.add[:] = np.asarray(_MESSAGE.encode(text), dtype=np.int64).view(np.int32)
  return parts


def read_message(reduced: Parts) -> str:
  """The speaker's text."""
  return _MESSAGE.decode(np.ascontiguousarray(reduced.add).view(np.int64))
