"""The restore's stream exchange: agree every stream, then move the bytes.

Each process knows only the streams it sends. Two reductions whose size grows with the
streams, not with the pairs of processes, tell every process every stream (`agree_streams`:
how many each process sends, then one slot per stream with its destination and size); the
streams then travel as one `transport.Transfer`, the same plan on every process. Whether
every process can go on, and how many streams there are, is agreed before
(restore/outcome.agree_serve). Replication agrees its fixed copy edges' sizes itself
(peers/send_census) and uses `outgoing_sizes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from orbax_mtc import reduction, transport
from orbax_mtc.peers import send_census
from orbax_mtc.peers.stream import OutgoingStream
from orbax_mtc.reduction import Parts

Edge = tuple[int, int]  # (source process, destination process)


def counts_parts(sends: Mapping[int, int], me: int, processes: int, most: int) -> Parts:
  """How many streams this process sends, in its own slot (the others add 0): one uint8
  (maxed) a process when no process sends more than 255, else one int32 (summed)."""
  narrow = most <= 255
  parts = Parts.empty(0 if narrow else processes, 0, processes if narrow else 0)
  (parts.flags if narrow else parts.add)[me] = sum(1 for n in sends.values() if n > 0)
  return parts


def slots_parts(sends: Mapping[int, int], me: int, first: int, total: int, bits: int) -> Parts:
  """Per stream slot (this process's run from `first`, by destination): its destination + 1
  and its byte count (send_census's widths: one int32 to 31 bits, a uint8 more to 39, two
  31-bit halves beyond)."""
  mine = sorted((d, n) for d, n in sends.items() if n > 0)
  edges = [(me if first <= j < first + len(mine) else -1, 0) for j in range(total)]
  sizes = np.zeros(total, np.int64)
  for i, (_, n) in enumerate(mine):
    sizes[first + i] = n
  parts = send_census.sizes(edges, me, sizes, bits)
  where = Parts.empty(total, 0)
  for i, (dest, _) in enumerate(mine):
    where.add[first + i] = dest + 1
  return Parts(np.concatenate([where.add, parts.add]), parts.top, parts.flags)


def agree_streams(sends: Mapping[int, int], me: int, processes: int, total: int, bits: int,
                  most: int, reduce: Callable[[reduction.Round], Parts]
                  ) -> list[transport.Stream]:
  """Every stream of the exchange, the same list on every process, from two reductions: the
  streams each process sends (1 byte a process, 4 past 255), then one slot per stream (its
  destination and size: 8 to 12 bytes), each sender filling its run of slots. `total` (the
  streams' count), `bits` (the widest size's bit length) and `most` (the most streams of one
  process) are agreed already."""
  reduced = reduce(reduction.Round(sends, me, lambda s, p: counts_parts(s, p, processes, most)))
  counts = reduced.flags if most <= 255 else reduced.add
  starts = np.concatenate([[0], np.cumsum(counts.astype(np.int64))])
  reduced = reduce(reduction.Round(sends, me, lambda s, p: slots_parts(
      s, p, int(starts[p]), total, bits)))
  dests = reduced.add[:total].astype(np.int64) - 1
  sizes = send_census.read_sizes(
      Parts(reduced.add[total:], reduced.top, reduced.flags), [(0, 0)] * total, bits)
  sources = np.repeat(np.arange(processes), counts.astype(np.int64))
  return [transport.Stream(int(src), int(dst), int(n))
          for src, dst, n in zip(sources, dests, sizes, strict=True)]


def transfer(streams: Sequence[transport.Stream], me: int,
             outgoing: Mapping[int, OutgoingStream], *,
             sink_for: Callable[[transport.Stream], transport.Sink], chunk_limit: int,
             window: int, allgather: Callable[[np.ndarray], np.ndarray]) -> transport.Transfer:
  """The agreed streams as one transfer (the same plan on every process)."""
  return transport.Transfer(list(streams), me=me,
                            reader_for=lambda s: outgoing[s.destination].read,
                            sink_for=sink_for, chunk_limit=chunk_limit, window=window,
                            allgather=allgather)


def outgoing_sizes(edges: Sequence[Edge], me: int, outgoing: dict[int, OutgoingStream]
                   ) -> np.ndarray:
  """Per edge, the bytes this process sends on it (0 where it is not the sender)."""
  return np.asarray([outgoing[dst].nbytes if src == me and dst in outgoing else 0
                     for src, dst in edges], dtype=np.int64)

