"""The restore's stream exchange: agree every stream, then move the bytes.

Each process knows only the streams it sends. A `ppermute` needs the same pairs on every
process, so every process learns every stream's two ends, but not its size: three
reductions (`agree_streams`) give how many streams each process sends (a few bits a
process), each stream's destination (the bits of a process index a stream, each sender
filling its run of fields) and, per round of the transfer (topology.transfer_rounds), the
largest stream, which is all the transfer's plan needs. A stream carries its own length in
a `FRAME`-byte prefix, so its receiver keeps exactly its bytes. Whether every process can go
on, and how many streams there are, is agreed before (restore/outcome.agree_serve).
Replication agrees its fixed copy edges' sizes itself (peers/send_census) and uses
`outgoing_sizes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from orbax_mtc import reduction, topology, transport
from orbax_mtc.local import format as local_format
from orbax_mtc.peers.stream import OutgoingStream
from orbax_mtc.reduction import Parts

Edge = tuple[int, int]  # (source process, destination process)


FRAME = local_format.ALIGN  # the length prefix: the payload after it stays aligned
_UNIT_BITS = 12  # round sizes travel in 4 KiB units (or coarser, past 4 TiB a stream)


def _unit(bits: int) -> int:
  """Bytes per unit of a round's size, for streams of at most `bits`-bit payloads: the
  framed size in units fits 30 bits."""
  return 1 << max(_UNIT_BITS, bits + 1 - 30)


def _width(n: int) -> int:
  return max(1, int(n).bit_length())


def _own(sends: Mapping[int, int]) -> list[tuple[int, int]]:
  return sorted((d, n) for d, n in sends.items() if n > 0)


def counts_parts(sends: Mapping[int, int], me: int, processes: int, most: int) -> Parts:
  """How many streams this process sends, in its own field of bit_length(`most`) bits."""
  width = _width(most)
  parts = Parts.empty(reduction.field_words(processes, width), 0)
  reduction.pack_fields(parts.add, me, width, [len(_own(sends))])
  return parts


def destinations_parts(sends: Mapping[int, int], first: int, total: int, processes: int
                       ) -> Parts:
  """Per stream of this process (its run of fields from `first`, by destination): the
  destination, in bit_length(processes - 1) bits."""
  width = _width(processes - 1)
  parts = Parts.empty(reduction.field_words(total, width), 0)
  reduction.pack_fields(parts.add, first, width, [d for d, _ in _own(sends)])
  return parts


def largest_parts(sends: Mapping[int, int], me: int,
                  rounds: Sequence[Sequence[Edge]], unit: int) -> Parts:
  """Per round of the transfer, the framed size of this process's stream in it, in units
  (maxed: the round's largest)."""
  parts = Parts.empty(0, len(rounds))
  mine = dict(_own(sends))
  for r, edges in enumerate(rounds):
    for src, dst in edges:
      if src == me:
        parts.top[r] = -(-(mine[dst] + FRAME) // unit)
  return parts


@dataclasses.dataclass(frozen=True)
class Plan:
  """The exchange's plan, the same on every process but for the sizes of its own streams.

  Attributes:
    streams: Every stream: those this process sends at their framed size, the others at
      their round's largest (an upper bound, enough for the transfer's plan).
    rounds: The transfer's rounds (topology.transfer_rounds of the streams' ends).
  """

  streams: list[transport.Stream]
  rounds: list[tuple[Edge, ...]]


def agree_streams(sends: Mapping[int, int], me: int, processes: int, total: int, bits: int,
                  most: int, reduce: Callable[[reduction.Round], Parts]) -> Plan:
  """Every stream's ends and each round's largest stream, from three reductions (collective).

  Args:
    sends: The payload bytes this process sends, per destination.
    me: This process's index.
    processes: The process count.
    total: How many streams there are in all (agreed).
    bits: The widest payload size's bit length (agreed).
    most: The most streams one process sends (agreed).
    reduce: The collective: a round's reduced `Parts`.
  """
  reduced = reduce(reduction.Round(sends, me, lambda s, p: counts_parts(s, p, processes, most)))
  counts = reduction.unpack_fields(reduced.add, _width(most), processes)
  starts = np.concatenate([[0], np.cumsum(counts)])
  reduced = reduce(reduction.Round(sends, me, lambda s, p: destinations_parts(
      s, int(starts[p]), total, processes)))
  dests = reduction.unpack_fields(reduced.add, _width(processes - 1), total)
  sources = np.repeat(np.arange(processes), counts)
  edges = [(int(src), int(dst)) for src, dst in zip(sources, dests, strict=True)]
  rounds = topology.transfer_rounds(edges)
  unit = _unit(bits)
  largest = reduce(reduction.Round(sends, me, lambda s, p: largest_parts(s, p, rounds, unit))).top
  framed = {d: n + FRAME for d, n in _own(sends)}
  streams = [transport.Stream(src, dst, framed[dst] if src == me else int(largest[r]) * unit)
             for r, round_edges in enumerate(rounds) for src, dst in round_edges]
  return Plan(streams, rounds)


def _framed_reader(stream: OutgoingStream) -> transport.Reader:
  """Reads the stream behind its length prefix."""
  prefix = np.zeros(FRAME, np.uint8)
  prefix[:8] = np.frombuffer(int(stream.nbytes).to_bytes(8, "little"), np.uint8)

  def read(offset: int, out: np.ndarray) -> None:
    head = max(0, min(FRAME - offset, out.nbytes))
    out[:head] = prefix[offset:offset + head]
    if head < out.nbytes:
      stream.read(offset + head - FRAME, out[head:])
  return read


def _unframing_sink(stream: transport.Stream,
                    sink_for: Callable[[transport.Stream], transport.Sink]) -> transport.Sink:
  """A sink of the framed stream that hands the payload, and only it, to the sink
  `sink_for` makes for the stream at its exact length (known from the first chunk)."""
  inner: list[transport.Sink] = []
  length = [0]

  def sink(offset: int, data: np.ndarray) -> None:
    if offset == 0:
      if data.nbytes < FRAME:
        raise local_format.CorruptStepError("a stream shorter than its length prefix")
      length[0] = int.from_bytes(bytes(data[:8]), "little")
      if length[0] > stream.nbytes - FRAME:
        raise local_format.CorruptStepError(
            f"a stream of {length[0]} bytes in a round of at most {stream.nbytes - FRAME}")
      inner.append(sink_for(transport.Stream(stream.source, stream.destination, length[0])))
      offset, data = FRAME, data[FRAME:]
    at = offset - FRAME
    if inner and at < length[0]:
      inner[0](at, data[:length[0] - at])
  return sink


def transfer(plan: Plan, me: int, outgoing: Mapping[int, OutgoingStream], *,
             sink_for: Callable[[transport.Stream], transport.Sink], chunk_limit: int,
             window: int, reduce: Callable[[reduction.Round], Parts]) -> transport.Transfer:
  """The agreed streams as one transfer (the same plan on every process); `sink_for` gets
  each incoming stream at its exact length."""
  return transport.Transfer(plan.streams, me=me,
                            reader_for=lambda s: _framed_reader(outgoing[s.destination]),
                            sink_for=lambda s: _unframing_sink(s, sink_for),
                            chunk_limit=chunk_limit, window=window, reduce=reduce,
                            rounds=plan.rounds)


def outgoing_sizes(edges: Sequence[Edge], me: int, outgoing: dict[int, OutgoingStream]
                   ) -> np.ndarray:
  """Per edge, the bytes this process sends on it (0 where it is not the sender)."""
  return np.asarray([outgoing[dst].nbytes if src == me and dst in outgoing else 0
                     for src, dst in edges], dtype=np.int64)

