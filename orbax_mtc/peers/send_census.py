"""Replication's agreements as reductions (pure): what each process adds, and the answer.

The copies of a step move once every node has committed it. Each `save()` call asks, while
some node still writes, whether all have: one **status** round of a few counts (the
processes that failed, those still writing, the lowest failed one, the widest stream size),
the same size at any process count. Once all have, one **sizes** round agrees every copy
stream's byte count, which the transfer's plan needs on every process: each stream's sender
adds its count in the stream's slot and the others add 0, so the sum is the count (one int32
per stream, or two 31-bit halves when some stream is 2 GiB or more). After the transfer, an
**outcome** round counts the processes whose chunks failed and names the lowest, whose
message follows in one more round only then.

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
_MESSAGE = row_codec.Text(1200)


@dataclasses.dataclass(frozen=True)
class Votes:
  """The status round's answer.

  Attributes:
    failed: The processes that could not commit (or read) the step.
    writing: How many processes still write it.
    wide: Some stream has 2 GiB or more (its size travels as two halves).
  """

  failed: Who
  writing: int
  wide: bool


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
               int(reduced.top[1]) > _NARROW)


def sizes(edges: Sequence[tuple[int, int]], me: int, outgoing: np.ndarray,
          wide: bool) -> Parts:
  """Per stream, its byte count where this process sends it (0 elsewhere)."""
  width = 2 if wide else 1
  parts = Parts.empty(width * len(edges), 0)
  for j, (source, _) in enumerate(edges):
    if source == me:
      n = int(outgoing[j])
      parts.add[width * j:width * (j + 1)] = reduction.split(n) if wide else [n]
  return parts


def read_sizes(reduced: Parts, edges: Sequence[tuple[int, int]], wide: bool) -> np.ndarray:
  """Every stream's agreed byte count (int64, in the order of `edges`)."""
  values = reduced.add.astype(np.int64)
  if wide:
    values = values.reshape(len(edges), 2)
    return np.asarray([reduction.join(h, lo) for h, lo in values], dtype=np.int64)
  return values


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
