"""The one stream exchange: agree every stream's size, then move the bytes.

Save-side replication (a committed step to its peers) and restore (a whole step to a node
that lost it) move bytes the same way. Each process knows only the streams it sends; one
all-gather of an agreement record plus a byte count per edge tells every process every
stream's size (a negative count: the sender cannot serve it), and whether every process can
go on. The streams then travel as one `transport.Transfer`, the same plan on every process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from orbax_mtc import agreement, transport
from orbax_mtc.peers.stream import OutgoingStream

R = TypeVar("R")
Edge = tuple[int, int]  # (source process, destination process)


@dataclasses.dataclass
class Exchange(Generic[R]):
  """The agreed outcome: every process's record, every edge's size (the sender's count), and
  the transfer, when the caller's `proceed` accepted them."""

  records: list[R]
  sizes: np.ndarray
  transfer: transport.Transfer | None

  def failed_edges(self) -> list[int]:
    """Indices of the edges whose sender could not serve them."""
    return [j for j, n in enumerate(self.sizes) if n < 0]


def exchange(edges: Sequence[Edge], me: int, outgoing: dict[int, OutgoingStream],
             sizes: np.ndarray, record: R, allgather: Callable[[np.ndarray], np.ndarray], *,
             proceed: Callable[[list[R], np.ndarray], bool],
             sink_for: Callable[[transport.Stream], transport.Sink],
             chunk_limit: int, window: int) -> Exchange[R]:
  """Agrees the streams of `edges` and, if `proceed` says so, plans their transfer.

  Collective: every process calls it with the same edges.

  Args:
    edges: (source, destination) of every stream, the same list on every process.
    me: this process.
    outgoing: destination -> the stream this process sends it.
    sizes: per edge, this process's byte count (0 where it does not send, -1 where it
      cannot serve the edge).
    record: this process's agreement record (status, message), gathered with the sizes.
    allgather: the collective all-gather of one int64 row.
    proceed: given every record and every edge's size, whether the bytes move.
    sink_for: where this process's incoming stream goes.
    chunk_limit: largest chunk, in bytes.
    window: chunks in flight at once.

  Returns:
    The Exchange; its transfer is None when `proceed` said no (the caller then runs,
    advances or drops nothing).
  """
  gathered = agreement.gather_with_sizes(record, sizes, allgather)
  records = [r for r, _ in gathered]
  # Each edge's size is its sender's count (the others send 0 on it).
  agreed = np.asarray([gathered[src][1][j] for j, (src, _) in enumerate(edges)],
                      dtype=np.int64)
  if not proceed(records, agreed):
    return Exchange(records, agreed, None)
  streams = [transport.Stream(src, dst, int(n))
             for (src, dst), n in zip(edges, agreed, strict=True)]
  transfer = transport.Transfer(streams, me=me,
                                reader_for=lambda s: outgoing[s.destination].read,
                                sink_for=sink_for, chunk_limit=chunk_limit, window=window,
                                allgather=allgather,
                                viewer_for=lambda s: outgoing[s.destination].view)
  return Exchange(records, agreed, transfer)


def outgoing_sizes(edges: Sequence[Edge], me: int, outgoing: dict[int, OutgoingStream]
                   ) -> np.ndarray:
  """Per edge, the bytes this process sends on it (0 where it is not the sender)."""
  return np.asarray([outgoing[dst].nbytes if src == me and dst in outgoing else 0
                     for src, dst in edges], dtype=np.int64)

