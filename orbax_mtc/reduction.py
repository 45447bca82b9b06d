"""Agreements by reduction: fixed-size vectors summed and maxed over every process (pure).

An all-gather hands every process one row per process, so its size grows with the cluster
(a 3 KiB row is 300 MiB at 100,000 hosts). An all-reduce hands every process one vector of
the size each contributes, whatever the process count. A round of an agreement is therefore
three vectors per process (`Parts`): int32 values summed (`add`: counts, and one-hot slots
that only one process fills, such as process 0's clock or the lowest faulty process's
message), int32 values maxed (`top`: maxima, and minima as negated maxima), and uint8 values
maxed (`flags`: a bitwise OR, one byte per slot). Every value is int32 or narrower, so the
same vectors reduce with or without `jax_enable_x64`; 64-bit values travel as two 31-bit
halves.

`combine` is the reduction itself in numpy: what the collective computes (collectives.py),
and what the tests and the scale bench use in place of one. No I/O and no JAX here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

LOW = -(2 ** 31)  # the identity of `top`: a process that has nothing to say there
_HALF = 31  # bits per half of a 62-bit value: both halves are non-negative int32


@dataclasses.dataclass
class Parts:
  """One process's contribution to one round, or the round's reduced result.

  Attributes:
    add: int32, summed over the processes.
    top: int32, maxed over the processes (`LOW`: nothing).
    flags: uint8, maxed over the processes (0 or 1: an OR).
  """

  add: np.ndarray
  top: np.ndarray
  flags: np.ndarray

  @classmethod
  def empty(cls, add: int, top: int, flags: int = 0) -> Parts:
    """A contribution that says nothing (the identity of the reduction)."""
    return cls(np.zeros(add, np.int32), np.full(top, LOW, np.int32), np.zeros(flags, np.uint8))

  @property
  def shape(self) -> tuple[int, int, int]:
    """The vectors' lengths: what every process must agree on before the round."""
    return (self.add.size, self.top.size, self.flags.size)

  @property
  def nbytes(self) -> int:
    """Bytes of one contribution (and of the reduced result)."""
    return self.add.nbytes + self.top.nbytes + self.flags.nbytes


def combine(contributions: Iterable[Parts]) -> Parts:
  """The reduction of several contributions (what an all-reduce computes).

  Raises:
    ValueError: If the contributions' shapes differ, or there are none.
  """
  items = list(contributions)
  if not items or len({p.shape for p in items}) != 1:
    raise ValueError(f"contributions of shapes {sorted({p.shape for p in items})}")
  return Parts(np.sum([p.add for p in items], axis=0, dtype=np.int64).astype(np.int32),
               np.max([p.top for p in items], axis=0).astype(np.int32),
               np.max([p.flags for p in items], axis=0).astype(np.uint8))


def split(value: int) -> tuple[int, int]:
  """A value in [0, 2**62) as two non-negative int32 halves (high, low)."""
  value = int(value)
  if not 0 <= value < 2 ** (2 * _HALF):
    raise ValueError(f"{value} does not fit two {_HALF}-bit halves")
  return value >> _HALF, value & ((1 << _HALF) - 1)


def join(high: int, low: int) -> int:
  """The value `split` cut."""
  return (int(high) << _HALF) | int(low)


# A round of at most this many processes whose rows together fit in this many bytes is one
# all-gather of each process's vectors as one row, reduced by `combine_rows` on every
# process: one collective instead of one per reduction and dtype (each collective costs a
# scheduling round trip on a busy host, more than the few bytes). Other rounds are
# all-reduces: what a process receives stays bounded however many processes there are.
GATHERED_ROUND_PROCESSES = 32
GATHERED_ROUND_BYTES = 64 << 10


def gathers(vector_bytes: int, processes: int) -> bool:
  """Whether a round of `vector_bytes` per process is gathered (GATHERED_ROUND_*)."""
  return processes <= GATHERED_ROUND_PROCESSES and \
      vector_bytes * processes <= GATHERED_ROUND_BYTES


def received_bytes(vector_bytes: int, processes: int) -> int:
  """Bytes one process receives in a round of `vector_bytes` per process: the other rows of a
  gathered round (`gathers`), else what an all-reduce brings (a ring: the reduce-scatter and
  the all-gather each bring (P - 1) / P of the vector); 0 for one process."""
  if processes <= 1:
    return 0
  if gathers(vector_bytes, processes):
    return gathered_bytes(vector_bytes, processes)
  return -(-2 * vector_bytes * (processes - 1) // processes)


def row_bytes(parts: Parts) -> np.ndarray:
  """One process's vectors as one row of bytes (a gathered round's row)."""
  return np.concatenate([parts.add.view(np.uint8), parts.top.view(np.uint8), parts.flags])


def combine_rows(rows: np.ndarray, shape: tuple[int, int, int]) -> Parts:
  """The reduction of gathered `rows` (one per process, `row_bytes` of vectors of `shape`,
  maybe padded at the end): what `combine` computes, in one pass over the rows."""
  add, top, flags = shape
  ends = np.cumsum([4 * add, 4 * top, flags])
  added = np.ascontiguousarray(rows[:, :ends[0]]).view(np.int32)
  topped = np.ascontiguousarray(rows[:, ends[0]:ends[1]]).view(np.int32)
  flagged = rows[:, ends[1]:ends[2]]
  return Parts(added.sum(axis=0, dtype=np.int64).astype(np.int32),
               topped.max(axis=0, initial=LOW).astype(np.int32),
               flagged.max(axis=0, initial=0).astype(np.uint8))


def gathered_bytes(row_bytes: int, processes: int) -> int:
  """Bytes one process receives in an all-gather of one `row_bytes` row per process."""
  return row_bytes * max(processes - 1, 0)


@dataclasses.dataclass(frozen=True)
class Who:
  """Which processes say something, as a reduction can tell: how many, and the lowest.

  Attributes:
    count: How many processes.
    lowest: The lowest of them; -1 when there are none.
  """

  count: int = 0
  lowest: int = -1

  def __bool__(self) -> bool:
    return self.count > 0

  def __str__(self) -> str:
    if self.count <= 1:
      return f"[{self.lowest}]" if self.count else "[]"
    return f"{self.count} processes (the lowest: {self.lowest})"

  @classmethod
  def of(cls, mask: Iterable[bool]) -> Who:
    """From one flag per process (index = process)."""
    found = np.flatnonzero(np.asarray(list(mask), dtype=bool))
    return cls(int(found.size), int(found[0]) if found.size else -1)


def pack_bit(words: np.ndarray, index: int) -> None:
  """Sets bit `index` of an int32 bitmap. Only process `index` sets it, so a sum of the
  processes' bitmaps is their OR (no carry ever reaches another bit)."""
  word, bit = divmod(index, 32)
  words.view(np.uint32)[word] |= np.uint32(1 << bit)


def bitmap_words(processes: int) -> int:
  """int32 words of a bitmap with one bit per process."""
  return -(-processes // 32)


def unpack_bits(words: np.ndarray, processes: int) -> np.ndarray:
  """The processes whose bit is set in a summed bitmap, ascending."""
  bits = np.unpackbits(np.asarray(words, dtype=np.int32).view(np.uint8), bitorder="little")
  return np.flatnonzero(bits[:processes])


def field_words(fields: int, width: int) -> int:
  """int32 words of a bitmap of `fields` fields of `width` bits each."""
  return -(-fields * width // 32)


def pack_fields(words: np.ndarray, first: int, width: int, values: Iterable[int]) -> None:
  """Writes `values` as `width`-bit fields from field `first` on, in an int32 bitmap. Each
  field is written by one process only, so a sum of the processes' bitmaps holds every
  field (bits never overlap, so no carry ever crosses into a neighbour's field)."""
  bits = words.view(np.uint32)
  for i, value in enumerate(values):
    value = int(value)
    if not 0 <= value < 1 << width:
      raise ValueError(f"{value} does not fit a {width}-bit field")
    at = (first + i) * width
    for b in range(width):
      if value >> b & 1:
        word, bit = divmod(at + b, 32)
        bits[word] |= np.uint32(1 << bit)


def unpack_fields(words: np.ndarray, width: int, fields: int) -> np.ndarray:
  """The `fields` fields of `width` bits a summed bitmap holds, as int64."""
  bits = np.unpackbits(np.asarray(words, dtype=np.int32).view(np.uint8), bitorder="little")
  bits = bits[:fields * width].reshape(fields, width).astype(np.int64)
  return bits @ (np.int64(1) << np.arange(width, dtype=np.int64))


def flag_parts(flag: bool, me: int) -> Parts:
  """One flag of this process: counted, and the lowest process raising it."""
  parts = Parts.empty(1, 1)
  if flag:
    parts.add[0], parts.top[0] = 1, -me
  return parts


def read_flag(reduced: Parts) -> Who:
  """Who raised the flag of a reduced `flag_parts` round."""
  count = int(reduced.add[0])
  return Who(count, int(-reduced.top[0]) if count else -1)


@dataclasses.dataclass(frozen=True)
class Round:
  """One round of an agreement: this process's facts and how any process's facts become its
  contribution (so a simulated cluster can add up many processes' facts).

  Attributes:
    record: This process's facts.
    process: This process's index.
    contribute: `contribute(record, process)`, a process's `Parts`.
  """

  record: Any
  process: int
  contribute: Callable[[Any, int], Parts]

  def parts(self) -> Parts:
    """This process's contribution."""
    return self.contribute(self.record, self.process)
