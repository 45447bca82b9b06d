"""A restore attempt's agreed outcome, from gathered records or from reductions (pure).

The build's outcome (`BuildRecord`, after the transfer, and when the data iterators are set)
was an all-gather of a 1.2 KiB row per process. Here each process adds (reduction.Parts):

* **statuses**: per status, how many processes report it and the lowest of them; how many
  built a shard that is not a saved tile of their own rank (`moved`) and how many name a bad
  tile's saved rank; a bitmap of the processes whose saved rank did not come from their own
  current folder (each sets only its own bit, so the sum is the OR): 4 x (12 + P / 32) +
  4 x 10 bytes;
* **ranks** (only when a bad tile is named): one uint8 max per saved rank, 1 where its tile
  proved damaged; its folder is the one the plan's server of that rank served, so the source
  (process, rank) follows from the rank;
* **messages** (only when something failed): the message of the lowest process of each failed
  status, each in its own one-hot slot.

`agree_serve` reduces the exchange's `ServeRecord`s (and their early `BuildRecord`s) the same
way; `of_records` reads gathered records into the same `Outcome`: the answer the tests hold the
reductions to. No I/O and no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_mtc import reduction, row_codec
from orbax_mtc.agreement import BuildRecord, ServeRecord, Status
from orbax_mtc.reduction import LOW, Parts

_STATES = len(Status)
_SPOKEN = (Status.MISMATCH, Status.FAILED, Status.UNUSABLE, Status.LACKING)
_MESSAGE = row_codec.Text(1200)
_WORDS = 2 * _MESSAGE.size  # int32 values of one message


@dataclasses.dataclass(frozen=True)
class Outcome:
  """An attempt's outcome, the same on every process.

  Attributes:
    counts: Per status, how many processes report it.
    said: Per failed status, (its lowest process, that process's message).
    failed: The FAILED processes named, with their messages (all of them from records; the
      lowest from reductions, `counts` telling how many).
    moved: Some process built a shard that is not a saved tile of its own rank.
    not_in_place: The processes whose saved rank did not come from their own current folder.
    bad: (process, saved rank) folders proved damaged.
    lacking: (process, saved rank) folders without a per-process item asked for.
  """

  counts: Mapping[Status, int]
  said: Mapping[Status, tuple[int, str]]
  failed: Mapping[int, str]
  moved: bool = False
  not_in_place: tuple[int, ...] = ()
  bad: frozenset[tuple[int, int]] = frozenset()
  lacking: frozenset[tuple[int, int]] = frozenset()

  @property
  def ok(self) -> bool:
    return all(n == 0 for s, n in self.counts.items() if s != Status.OK)


def of_records(records: Sequence[Any]) -> Outcome:
  """The outcome of gathered `ServeRecord`s or `BuildRecord`s (index = process)."""
  counts = {s: sum(r.status == s for r in records) for s in Status}
  said = {}
  for status in _SPOKEN:
    first = next((p for p, r in enumerate(records) if r.status == status), None)
    if first is not None:
      said[status] = (first, records[first].message)
  bad = {(p, rank) for p, r in enumerate(records) if r.status != Status.LACKING
         for rank in getattr(r, "failed_ranks", ())}
  bad |= {(r.bad_process, r.bad_rank) for r in records if getattr(r, "bad_process", -1) >= 0}
  return Outcome(
      counts, said, {p: r.message for p, r in enumerate(records) if r.status == Status.FAILED},
      any(getattr(r, "moved", False) for r in records),
      tuple(p for p, r in enumerate(records) if not getattr(r, "in_place", False)),
      frozenset(bad), frozenset((p, rank) for p, r in enumerate(records)
                                if r.status == Status.LACKING for rank in r.failed_ranks))


def statuses(record: BuildRecord, me: int, processes: int) -> Parts:
  """This process's status, `moved`, bad-tile flag and not-in-place bit."""
  words = reduction.bitmap_words(processes)
  parts = Parts.empty(_STATES + 2 + words, _STATES)
  parts.add[int(record.status)] = 1
  parts.top[int(record.status)] = -me
  parts.add[_STATES] = int(record.moved)
  parts.add[_STATES + 1] = int(record.bad_rank >= 0)
  if not record.in_place:
    reduction.pack_bit(parts.add[_STATES + 2:], me)
  return parts


def ranks(record: BuildRecord, count: int) -> Parts:
  """1 at the saved rank whose tile this process found damaged."""
  parts = Parts.empty(0, 0, count)
  if 0 <= record.bad_rank < count:
    parts.flags[record.bad_rank] = 1
  return parts


def messages(record: BuildRecord, me: int, speakers: Sequence[int]) -> Parts:
  """This process's message in the slot of each status it is the lowest of."""
  parts = Parts.empty(_WORDS * len(speakers), 0)
  for i, speaker in enumerate(speakers):
    if speaker == me:
      parts.add[i * _WORDS:(i + 1) * _WORDS] = np.asarray(
          _MESSAGE.encode(record.message), np.int64).view(np.int32)
  return parts


def agree(record: BuildRecord, me: int, processes: int, server_of: Mapping[int, int],
          count: int, reduce: Callable[[reduction.Round], Parts]) -> Outcome:
  """The outcome by reductions (every branch reads reduced data only: rule 8).

  Args:
    record: This process's outcome.
    me: This process.
    processes: The process count.
    server_of: The plan's serving process per saved rank.
    count: The saved ranks of the save (the ranks round's length).
    reduce: The collective.
  """
  first = reduce(reduction.Round(record, me, lambda r, p: statuses(r, p, processes)))
  return _finish(record, me, first, processes, server_of, count, reduce)


def _finish(record: BuildRecord, me: int, first: Parts, processes: int,
            server_of: Mapping[int, int], count: int,
            reduce: Callable[[reduction.Round], Parts]) -> Outcome:
  """The outcome from a reduced statuses round, and the rounds that follow it if needed."""
  add, top = first.add.astype(np.int64), first.top.astype(np.int64)
  counts = {s: int(add[int(s)]) for s in Status}
  lowest = {s: int(-top[int(s)]) for s in Status if counts[s] and top[int(s)] != LOW}
  not_in_place = tuple(int(p) for p in reduction.unpack_bits(
      first.add[_STATES + 2:], processes))
  bad: frozenset[tuple[int, int]] = frozenset()
  if add[_STATES + 1]:
    flags = reduce(reduction.Round(record, me, lambda r, _: ranks(r, count))).flags
    bad = frozenset((server_of[int(r)], int(r)) for r in np.flatnonzero(flags)
                    if int(r) in server_of)
  said = _said(record, me, counts, lowest, reduce)
  failed = dict([said[Status.FAILED]]) if Status.FAILED in said else {}
  return Outcome(counts, said, failed, bool(add[_STATES]), not_in_place, bad)


def outcome_bytes(processes: int, count: int = 0, spoken: int = 0) -> int:
  """Bytes one process receives: the statuses round, plus the ranks round of `count` saved
  ranks when a bad tile is named, plus the messages round of `spoken` statuses."""
  vectors = [4 * (2 * _STATES + 2 + reduction.bitmap_words(processes))]
  vectors += [count] if count else []
  vectors += [4 * _WORDS * spoken] if spoken else []
  return sum(reduction.received_bytes(v, processes) for v in vectors)


# ----------------------------------------------------------------------------- the exchange


def serve_parts(record: ServeRecord, me: int, processes: int, sends: Mapping[int, int]
                ) -> Parts:
  """The exchange's first round: the early build's statuses (`statuses`), then this
  process's serving status, whether it names failed ranks, how many streams it sends (summed
  and maxed), and its widest stream's bit length."""
  early = statuses(record.early, me, processes)
  parts = Parts.empty(_STATES + 2, _STATES + 2)
  parts.add[int(record.status)] = 1
  parts.top[int(record.status)] = -me
  parts.add[_STATES] = int(bool(record.failed_ranks))
  parts.add[_STATES + 1] = sum(1 for n in sends.values() if n > 0)
  parts.top[_STATES] = max((int(n).bit_length() for n in sends.values()), default=0)
  parts.top[_STATES + 1] = parts.add[_STATES + 1]
  return Parts(np.concatenate([early.add, parts.add]), np.concatenate([early.top, parts.top]),
               early.flags)


@dataclasses.dataclass(frozen=True)
class Served:
  """The exchange's agreement before any byte moves.

  Attributes:
    serving: Whether every process can serve (else `raise_agreed` it).
    early: The build's outcome when every process built before the exchange and no stream
      is left, else None (build after the transfer).
    streams: How many streams move.
    bits: The widest stream's bit length.
    most: The most streams one process sends.
  """

  serving: Outcome
  early: Outcome | None
  streams: int
  bits: int
  most: int = 0


def agree_serve(record: ServeRecord, me: int, processes: int, server_of: Mapping[int, int],
                count: int, sends: Mapping[int, int],
                reduce: Callable[[reduction.Round], Parts]) -> Served:
  """The exchange's status by reductions: one round, and only on a failure the failed ranks
  and the lowest processes' messages (rule 8: branches read reduced data only)."""
  first = reduce(reduction.Round((record, sends), me, lambda rs, p: serve_parts(
      rs[0], p, processes, rs[1])))
  words = reduction.bitmap_words(processes)
  split = _STATES + 2 + words
  add, top = first.add.astype(np.int64), first.top.astype(np.int64)
  serve_add, serve_top = add[split:], top[_STATES:]
  counts = {s: int(serve_add[int(s)]) for s in Status}
  streams, bits, most = (int(serve_add[_STATES + 1]), int(serve_top[_STATES]),
                         int(serve_top[_STATES + 1]))
  if any(n for s, n in counts.items() if s != Status.OK):
    lowest = {s: int(-serve_top[int(s)]) for s in Status if counts[s]}
    bad = lacking = frozenset()
    if serve_add[_STATES]:
      codes = reduce(reduction.Round(record, me, lambda r, _: _failed_ranks(r, count))).flags
      named = [(server_of.get(int(rank)), int(rank), int(codes[rank]))
               for rank in np.flatnonzero(codes)]
      bad = frozenset((p, r) for p, r, c in named if p is not None and c == 1)
      lacking = frozenset((p, r) for p, r, c in named if p is not None and c == 2)
    said = _said(record, me, counts, lowest, reduce)
    failed = dict([said[Status.FAILED]]) if Status.FAILED in said else {}
    return Served(Outcome(counts, said, failed, bad=bad, lacking=lacking), None, streams, bits,
                  most)
  serving = Outcome(counts, {}, {})
  if streams or add[int(Status.NONE)]:
    return Served(serving, None, streams, bits, most)
  return Served(serving, _finish(record.early, me, Parts(
      first.add[:split], first.top[:_STATES], first.flags), processes, server_of, count,
      reduce), 0, bits)


def _failed_ranks(record: ServeRecord, count: int) -> Parts:
  """Per saved rank this process could not serve: 1 damaged, 2 lacking an item."""
  parts = Parts.empty(0, 0, count)
  code = {Status.UNUSABLE: 1, Status.LACKING: 2}.get(record.status, 0)
  for rank in record.failed_ranks:
    if code and 0 <= rank < count:
      parts.flags[rank] = code
  return parts


def _said(record: Any, me: int, counts: Mapping[Status, int], lowest: Mapping[Status, int],
          reduce: Callable[[reduction.Round], Parts]) -> dict[Status, tuple[int, str]]:
  """The lowest process's message per failed status (one round, none without a failure)."""
  spoken = [s for s in _SPOKEN if counts[s]]
  if not spoken:
    return {}
  speakers = [lowest[s] for s in spoken]
  told = reduce(reduction.Round(record, me, lambda r, p: messages(r, p, speakers))).add
  return {status: (speakers[i], _MESSAGE.decode(np.ascontiguousarray(
      told[i * _WORDS:(i + 1) * _WORDS]).view(np.int64))) for i, status in enumerate(spoken)}


def exchange_bytes(processes: int, streams: int, most: int = 1, rounds: int = 1) -> int:
  """Bytes one process receives agreeing an exchange that goes ahead: the status round, and
  with `streams` streams (at most `most` from one process, moved in `rounds` rounds) the
  rounds of peers/exchange.agree_streams: the counts (bit_length(most) bits a process), the
  destinations (bit_length(processes - 1) bits a stream) and each round's largest (4 bytes
  a round)."""
  words = reduction.bitmap_words(processes)
  vectors = [4 * (2 * _STATES + 4 + words) + 4 * (2 * _STATES + 2)]
  if streams:
    vectors.append(4 * reduction.field_words(processes, max(1, most.bit_length())))
    vectors.append(4 * reduction.field_words(streams, max(1, (processes - 1).bit_length())))
    vectors.append(4 * rounds)
  return sum(reduction.received_bytes(v, processes) for v in vectors)
