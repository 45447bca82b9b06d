"""Agreements on small records by reductions: who reports what (pure).

Some agreements need from the processes only a few facts: which processes failed (and the
messages of the lowest few), who says yes and who says no, how many are in each state, the
range of a number. `summarize` answers those from reductions whose size does not grow with
the cluster, in place of an all-gather of every process's record (a record with a fault
message is a 1.2 KiB row: 120 MiB for every process at 100,000 hosts).

A record (agreement.py) is summarized field by field, by its codec: `Bool` (who says True,
who False), `EnumCodec` (who is in each state), `Int` (the lowest and the highest value) and
one `Record(Fault)` (the faults: counted, the lowest `NAMED_FAULTS` processes' messages
travel, else the lowest failed backup's). Other codecs are refused: their records keep an
agreement of their own.

Rounds: one census (counts, lowest processes as negated maxima, the numbers' halves); then,
only when needed, a round for the numbers whose high halves differ, a round of bitmaps to
name several faulty processes, and a round for the named faults' messages.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orbax_mtc import agreement, reduction, row_codec
from orbax_mtc.reduction import LOW, Parts, Round, Who

NAMED_FAULTS = 4  # faults whose messages travel; the others are counted
_OFFSET = 1 << 61  # numbers in [-2**61, 2**61) travel as two non-negative 31-bit halves
_FAULT_ROW = 2 * row_codec.row_size(agreement.Fault)  # int32 values of one encoded Fault


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each field's facts sit in the census (per record type)."""

  bools: tuple[str, ...]
  enums: tuple[tuple[str, type[enum.IntEnum]], ...]
  ints: tuple[str, ...]
  fault: str | None

  @classmethod
  def of(cls, record_type: type) -> _Layout:
    bools, enums, ints, fault = [], [], [], None
    for name, codec in row_codec.codecs(record_type):
      if isinstance(codec, row_codec.Bool):
        bools.append(name)
      elif isinstance(codec, row_codec.EnumCodec):
        enums.append((name, codec.enum_type))
      elif type(codec) is row_codec.Int:
        ints.append(name)
      elif isinstance(codec, row_codec.Record) and codec.record_type is agreement.Fault \
          and fault is None:
        fault = name
      else:
        raise TypeError(f"{record_type.__name__}.{name}: a {type(codec).__name__} field "
                        "cannot be summarized; agree it another way")
    return cls(tuple(bools), tuple(enums), tuple(ints), fault)

  @property
  def states(self) -> int:
    return sum(len(kind) for _, kind in self.enums)

  @property
  def counts(self) -> int:
    """add: one count per bool, per enum member, and two for faults (own, backup)."""
    return len(self.bools) + self.states + (2 if self.fault else 0)

  @property
  def lowest(self) -> int:
    """top: the lowest process per bool (True, False), per enum member, per fault kind,
    then four halves per number (high max, high min, low max, low min)."""
    return 2 * len(self.bools) + self.states + (2 if self.fault else 0) + 4 * len(self.ints)


def _halves(value: int) -> tuple[int, int]:
  value = int(value)
  if not -_OFFSET <= value < _OFFSET:
    raise ValueError(f"{value} is outside the summarized range [-2**61, 2**61)")
  return reduction.split(value + _OFFSET)


def _fault_kinds(fault: agreement.Fault) -> tuple[bool, bool]:
  """(a fault of its own, a failed backup)."""
  return fault.present and fault.backup_step < 0, fault.present and fault.backup_step >= 0


def _census(record: Any, me: int, lay: _Layout) -> Parts:
  parts = Parts.empty(lay.counts, lay.lowest)
  add, top = parts.add, parts.top
  a = t = 0
  for name in lay.bools:
    value = bool(getattr(record, name))
    add[a] = int(value)
    top[t if value else t + 1] = -me
    a, t = a + 1, t + 2
  for name, kind in lay.enums:
    value = getattr(record, name)
    for member in kind:
      if value == member:
        add[a], top[t] = 1, -me
      a, t = a + 1, t + 1
  if lay.fault:
    for present in _fault_kinds(getattr(record, lay.fault)):
      if present:
        add[a], top[t] = 1, -me
      a, t = a + 1, t + 1
  for name in lay.ints:
    high, low = _halves(getattr(record, name))
    top[t:t + 4] = (high, -high, low, -low)
    t += 4
  return parts


def _lows(record: Any, lay: _Layout, highs: dict[str, tuple[int, int]]) -> Parts:
  """Per number whose high halves differ: the low half's max among the processes at the
  highest high half, and its min among those at the lowest."""
  parts = Parts.empty(0, 2 * len(highs))
  for i, (name, (high_max, high_min)) in enumerate(sorted(highs.items())):
    high, low = _halves(getattr(record, name))
    if high == high_max:
      parts.top[2 * i] = low
    if high == high_min:
      parts.top[2 * i + 1] = -low
  return parts


def _bitmaps(record: Any, me: int, lay: _Layout, processes: int) -> Parts:
  """Two bitmaps: processes with a fault of their own, with a failed backup."""
  words = reduction.bitmap_words(processes)
  parts = Parts.empty(2 * words, 0)
  for i, present in enumerate(_fault_kinds(getattr(record, lay.fault))):
    if present:
      reduction.pack_bit(parts.add[i * words:(i + 1) * words], me)
  return parts


def _messages(record: Any, me: int, lay: _Layout, chosen: Sequence[int]) -> Parts:
  parts = Parts.empty(len(chosen) * _FAULT_ROW, 0)
  if me in chosen:
    at = list(chosen).index(me) * _FAULT_ROW
    parts.add[at:at + _FAULT_ROW] = row_codec.encode(getattr(record, lay.fault)).view(np.int32)
  return parts


@dataclasses.dataclass(frozen=True)
class Summary:
  """What every process learns of every process's record (the same on every process).

  Attributes:
    processes: The process count.
    flags: Per bool field, (who says True, who says False).
    states: Per enum field, per member, who is in it.
    ranges: Per int field, (lowest, highest).
    faults: The named processes' faults: the lowest `NAMED_FAULTS` with a fault of their
      own, else the lowest failed backup.
    own_faults: Who reports a fault of their own.
    backup_faults: Who reports a failed backup.
    rounds: The reduced rounds, in order (their sizes are what each process received).
  """

  processes: int
  flags: dict[str, tuple[Who, Who]]
  states: dict[str, dict[enum.IntEnum, Who]]
  ranges: dict[str, tuple[int, int]]
  faults: dict[int, agreement.Fault]
  own_faults: Who
  backup_faults: Who
  rounds: tuple[Parts, ...]

  def true(self, name: str) -> Who:
    """Who says True in bool field `name`."""
    return self.flags[name][0]

  def false(self, name: str) -> Who:
    """Who says False in bool field `name`."""
    return self.flags[name][1]

  def state(self, name: str, member: enum.IntEnum) -> Who:
    """Who is in `member` of enum field `name`."""
    return self.states[name][member]

  def error_origins(self) -> dict[int, str]:
    """The named faults as CheckpointError origins ("<kind>: <message>")."""
    return {p: f"{f.kind}: {f.message}" for p, f in sorted(self.faults.items())}

  def named(self, what: str) -> str:
    """`what`, with how many processes failed when not all are named."""
    count = self.own_faults.count or self.backup_faults.count
    if count > len(self.faults):
      return f"{what} ({count} processes; the lowest {len(self.faults)} named)"
    return what


def summarize(record: Any, me: int, processes: int,
              reduce: Callable[[Round], Parts]) -> Summary:
  """Every process's facts about `record`'s fields, by reductions (collective: every
  process calls it with a record of the same type).

  Args:
    record: This process's record (agreement.py).
    me: This process's index.
    processes: The process count.
    reduce: The collective: a round's reduced `Parts`.

  Returns:
    The `Summary`.

  Raises:
    TypeError: The record has a field that cannot be summarized.
  """
  lay = _Layout.of(type(record))
  rounds: list[Parts] = []

  def run(contribute: Callable[[Any, int], Parts]) -> Parts:
    reduced = reduce(Round(record, me, contribute))
    rounds.append(reduced)
    return reduced

  census = run(lambda r, p: _census(r, p, lay))
  add, top = census.add, census.top

  def who(a: int, t: int) -> Who:
    count = int(add[a]) if a >= 0 else 0
    return Who(count, int(-top[t]) if top[t] != LOW else -1)

  flags: dict[str, tuple[Who, Who]] = {}
  a = t = 0
  for name in lay.bools:
    yes = who(a, t)
    no = Who(processes - yes.count, int(-top[t + 1]) if top[t + 1] != LOW else -1)
    flags[name] = (yes, no)
    a, t = a + 1, t + 2
  states: dict[str, dict[enum.IntEnum, Who]] = {}
  for name, kind in lay.enums:
    states[name] = {}
    for member in kind:
      states[name][member] = who(a, t)
      a, t = a + 1, t + 1
  own = backup = Who()
  if lay.fault:
    own, backup = who(a, t), who(a + 1, t + 1)
    t += 2
  ranges: dict[str, tuple[int, int]] = {}
  differ: dict[str, tuple[int, int]] = {}
  for name in lay.ints:
    high_max, high_min, low_max, low_min = (int(v) for v in top[t:t + 4])
    high_min, low_min = -high_min, -low_min
    if high_max == high_min:
      ranges[name] = (reduction.join(high_min, low_min) - _OFFSET,
                      reduction.join(high_max, low_max) - _OFFSET)
    else:
      differ[name] = (high_max, high_min)
    t += 4
  if differ:
    lows = run(lambda r, p: _lows(r, lay, differ)).top
    for i, (name, (high_max, high_min)) in enumerate(sorted(differ.items())):
      ranges[name] = (reduction.join(high_min, -int(lows[2 * i + 1])) - _OFFSET,
                      reduction.join(high_max, int(lows[2 * i])) - _OFFSET)
  chosen: tuple[int, ...] = ()
  if own.count == 1 or (not own and backup):
    chosen = (own.lowest if own else backup.lowest,)
  elif own.count > 1:
    words = reduction.bitmap_words(processes)
    maps = run(lambda r, p: _bitmaps(r, p, lay, processes)).add
    chosen = tuple(int(p) for p in reduction.unpack_bits(maps[:words], processes)
                   [:NAMED_FAULTS])
  faults: dict[int, agreement.Fault] = {}
  if chosen:
    texts = run(lambda r, p: _messages(r, p, lay, chosen)).add
    for i, p in enumerate(chosen):
      faults[p] = row_codec.decode(agreement.Fault, np.ascontiguousarray(
          texts[i * _FAULT_ROW:(i + 1) * _FAULT_ROW]).view(np.int64))
  return Summary(processes, flags, states, ranges, faults, own, backup, tuple(rounds))


def simulate(records: Sequence[Any]) -> Summary:
  """`summarize` over the given records, one per process, with the reduction computed in
  numpy (tests, the scale bench, and single-process fakes)."""
  processes = len(records)

  def reduce(rnd: Round) -> Parts:
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))

  return summarize(records[0], 0, processes, reduce)


def received_bytes(summary: Summary) -> int:
  """Bytes one process received over the summary's rounds (a ring all-reduce each)."""
  return sum(reduction.received_bytes(r.nbytes, summary.processes) for r in summary.rounds)
