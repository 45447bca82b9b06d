"""Moving bytes between processes with a jitted `ppermute` over the processes (`node_mesh`).

A transfer is a list of (source, destination, nbytes) streams known identically on every process.
It is cut into rounds in which every process sends at most one stream and receives at most one
(`topology.transfer_rounds`), and every round into fixed-size chunks. Each chunk is one
collective: a uint8 array sharded over the process axis (on CPU, each process's part split over
two of its devices: node_mesh.py says why), permuted point to point (gloo on CPU, NCCL on GPU,
ICI/DCN on TPU); a process that neither sends nor receives in a round still takes part with an
idle buffer. No all-gather of everything, no sockets of our own.

Collectives are issued only from the main thread and in the same order everywhere (rule 2).
Nothing that can fail on one process stands between two chunks (rule 9): a reader, a
placement or a sink that fails is recorded in `Transfer.failures` and the process goes on
taking part (zeros sent, a spare buffer placed, the bytes dropped), so that the caller agrees
the outcome after the last chunk instead of leaving the others inside a collective. The
spare buffers (one zero chunk per chunk length, kept for the process's life) are placed
before a transfer's first chunk, and a failure to place them is agreed there.
JAX dispatches them asynchronously, so `Transfer.advance` can issue a few chunks and return while
they run; at most `window` chunks are in flight, which bounds the extra memory per process to
about 2 x window x chunk bytes (each chunk has an input and an output buffer).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec

from orbax_mtc import node_mesh, reduction, topology
from orbax_mtc.local import read as local_read

_MIN_CHUNK = 4096

# Reads `nbytes` of an outgoing stream starting at `offset` into `out` (a uint8 view).
Reader = Callable[[int, np.ndarray], None]
# Receives one chunk of an incoming stream: (offset, bytes as a uint8 numpy array).
Sink = Callable[[int, np.ndarray], None]
# An outgoing stream's bytes [offset, offset + nbytes) in place, aligned, zero past its end,
# for sending without a copy into a send buffer, or already made into the chunk's collective
# input (`background_placer`); None where it has none (the Reader then fills one).
Viewer = Callable[[int, int], "np.ndarray | jax.Array | None"]


@dataclasses.dataclass(frozen=True)
class Stream:
  """One stream of bytes from one process to another.

  Attributes:
    source: Rank of the sending process.
    destination: Rank of the receiving process.
    nbytes: Length of the stream in bytes.
  """

  source: int
  destination: int
  nbytes: int


# JAX's CPU client runs a computation it estimates under 1,000 flops inline, on the calling
# thread and to its end, once its inputs are ready: a bare ppermute (no flops) would block
# `save()` for the whole chunk's transfer. A sum over the chunk's first bytes (2 flops a
# byte: a _MIN_CHUNK chunk's part on each of two devices is 4,095) makes it a computation
# the client dispatches, so the chunk moves while training goes on, without first copying
# it to make an input not ready.
_DISPATCHED_BYTES = _MIN_CHUNK


@functools.lru_cache(maxsize=64)
def _permute_fn(pairs: tuple[tuple[int, int], ...]):
  """The jitted ppermute of one chunk round; returns the received chunk (on CPU with the
  sum that makes it dispatched, unused)."""
  mesh = node_mesh.node_mesh()
  spec = PartitionSpec((node_mesh.AXIS, node_mesh.LOCAL))
  dispatched = mesh.devices.flat[0].platform == "cpu"

  def body(x):
    moved = jax.lax.ppermute(x, node_mesh.AXIS, perm=pairs)
    if not dispatched:
      return moved
    return moved, jnp.sum(x[:_DISPATCHED_BYTES].astype(jnp.float32))[None]

  permute = node_mesh.outside_user_mesh(jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=spec, out_specs=(spec, spec) if dispatched else spec)))
  return (lambda x: permute(x)[0]) if dispatched else permute


# chunk length -> a zero chunk placed on this process's devices: what a chunk whose own
# placement fails goes out from. Every process runs the same transfers, so every process
# holds the same lengths and agrees on reserving new ones at the same transfer.
_SPARES: dict[int, list[jax.Array]] = {}


class TransferError(RuntimeError):
  """A transfer could not start: some process could not place its spare chunk buffers."""


def place(buffer: np.ndarray, devices: Sequence[jax.Device]) -> list[jax.Array]:
  """Places one chunk's bytes on this process's transfer devices, in equal parts (every
  placement of this module goes through here)."""
  size = buffer.size // node_mesh.parts(buffer.size)
  return [jax.device_put(buffer[i * size:(i + 1) * size], device)
          for i, device in enumerate(devices)]


def background_placer(me: int) -> Callable[[np.ndarray], jax.Array] | None:
  """How a background thread may make a chunk read ahead for process `me`'s transfers into
  its collective's input, so that issuing it on the main thread is only the collective;
  None on accelerators.

  On a CPU device an aligned buffer is placed without a copy, so placing ahead costs no
  memory, and it took the main thread 0.85-1.5 ms a call under a save's load. On an
  accelerator it would hold every chunk read ahead in device memory as well: there chunks
  are placed as they are issued, a window at a time.
  """
  devices = node_mesh.devices_of(me)
  if devices[0].platform != "cpu":
    return None

  def place_ahead(buffer: np.ndarray) -> jax.Array:
    return node_mesh.split_input(place(buffer, devices))
  return place_ahead


def _chunk_bytes_for(largest: int, limit: int) -> int:
  """A power of two >= the largest stream, capped at `limit`: few distinct compiled shapes."""
  size = _MIN_CHUNK
  while size < largest and size < limit:
    size *= 2
  return min(size, max(limit, _MIN_CHUNK))


@dataclasses.dataclass
class _Chunk:
  pairs: tuple[tuple[int, int], ...]
  length: int
  send: Stream | None  # what this process sends in this chunk's round
  receive: Stream | None
  offset: int  # offset of this chunk inside the streams of its round


class Transfer:
  """One planned exchange of streams; identical plan on every process, local readers/sinks.

  Args:
    streams: Every stream of the exchange, identical on every process; empty streams are
      dropped.
    me: Rank of this process.
    reader_for: Returns the `Reader` of a stream this process sends.
    sink_for: Returns the `Sink` of a stream this process receives.
    chunk_limit: Largest chunk in bytes (chunks are powers of two, at least 4 KiB).
    window: Most chunks in flight at once (at least 1).
    reduce: The collective reduction of a round (reduction.py), to agree on placing spare
      chunk buffers of lengths no earlier transfer used (None: this process alone decides).
    viewer_for: Returns the `Viewer` of a stream this process sends, if it has one.
    rounds: `topology.transfer_rounds` of the streams' ends, when the caller has it already
      (the same on every process).

  Attributes:
    failures: What failed on this process while the bytes moved ("<what>: <type>: <message>");
      the caller agrees it once the transfer is over.

  Raises:
    ValueError: If two streams share the same (source, destination).
    topology.TopologyError: If a stream sends a process to itself or has a negative rank.
    TransferError: A process could not place its spare chunk buffers (agreed: raised on
      every process).
  """

  def __init__(self, streams: Sequence[Stream], *, me: int, reader_for: Callable[[Stream], Reader],
               sink_for: Callable[[Stream], Sink], chunk_limit: int, window: int = 2,
               reduce: Callable[[reduction.Round], reduction.Parts] | None = None,
               viewer_for: Callable[[Stream], Viewer | None] | None = None,
               rounds: Sequence[Sequence[tuple[int, int]]] | None = None):
    streams = [s for s in streams if s.nbytes > 0]
    by_edge = {(s.source, s.destination): s for s in streams}
    if len(by_edge) != len(streams):
      raise ValueError("two streams with the same (source, destination) in one transfer")
    self._me = me
    self._window = max(1, window)
    self._readers: dict[Stream, Reader] = {}
    self._viewers: dict[Stream, Viewer] = {}
    self._sinks: dict[Stream, Sink] = {}
    self._chunks: collections.deque[_Chunk] = collections.deque()
    if rounds is None:
      rounds = topology.transfer_rounds(list(by_edge))
    for round_edges in rounds:
      round_edges = [e for e in round_edges if e in by_edge]
      if not round_edges:
        continue
      round_streams = [by_edge[e] for e in round_edges]
      largest = max(s.nbytes for s in round_streams)
      length = _chunk_bytes_for(largest, chunk_limit)
      send = next((s for s in round_streams if s.source == me), None)
      receive = next((s for s in round_streams if s.destination == me), None)
      if send is not None:
        self._readers[send] = reader_for(send)
        viewer = viewer_for(send) if viewer_for is not None else None
        if viewer is not None:
          self._viewers[send] = viewer
      if receive is not None:
        self._sinks[receive] = sink_for(receive)
      for offset in range(0, largest, length):
        # The last chunk only as long as what is left (rounded up): a 1 KiB tail of a
        # manifest must not cost a whole chunk on the wire.
        size = min(length, _chunk_bytes_for(largest - offset, chunk_limit))
        self._chunks.append(_Chunk(tuple(round_edges), size, send, receive, offset))
    # (chunk, its collective's output, the send buffer to reuse or None for a stream's view)
    self._in_flight: collections.deque[tuple[_Chunk, jax.Array, np.ndarray | None]] = \
        collections.deque()
    self._free: list[np.ndarray] = []
    self.failures: list[str] = []
    # Seconds this process's calls waited for chunks to complete (a full window, the
    # last chunks): how far the link lags the pace they were issued at.
    self.waited_seconds = 0.0
    self._broken: set[Stream] = set()  # streams whose reader or sink failed once
    self._reserve({chunk.length for chunk in self._chunks}, reduce)

  def _reserve(self, lengths: set[int],
               reduce: Callable[[reduction.Round], reduction.Parts] | None) -> None:
    """Places a spare zero chunk of every length this transfer uses and no earlier one did
    (the same lengths on every process), and agrees that every process could."""
    devices = node_mesh.devices_of(self._me)
    new = sorted(n for n in lengths if n not in _SPARES)
    if not new:
      return
    placed: dict[int, list[jax.Array]] = {}
    error = ""
    try:
      for length in new:
        placed[length] = place(np.zeros(length, np.uint8), devices)
    except Exception as e:  # noqa: BLE001 - agreed right below
      error = f"{type(e).__name__}: {e}"
    if reduce is None:
      failed = reduction.Who(1, self._me) if error else reduction.Who()
    else:
      failed = reduction.read_flag(reduce(reduction.Round(bool(error), self._me,
                                                          reduction.flag_parts)))
    if failed:
      # Nobody keeps what it placed: every process's spares stay the same lengths.
      raise TransferError(
          f"process(es) {failed} could not place the transfer's chunk buffers on their "
          f"device{': ' + error if error else ''}. Free device memory (or lower "
          "chunk_mib) and retry.")
    _SPARES.update(placed)

  @property
  def remaining_chunks(self) -> int:
    """Chunks not yet issued (the same number on every process)."""
    return len(self._chunks)

  @property
  def issued(self) -> bool:
    """True once every chunk has been issued (the same moment on every process)."""
    return not self._chunks

  def _fail(self, what: str, error: BaseException) -> None:
    message = f"{what}: {type(error).__name__}: {error}"
    logging.warning("orbax-mtc: transfer: %s", message)
    self.failures.append(message)

  @property
  def moving_chunks(self) -> int:
    """Chunks issued and not yet complete on this process (a local view: no collective)."""
    return sum(1 for _, out, _ in self._in_flight if not out.is_ready())

  @property
  def arrived(self) -> bool:
    """Every chunk issued and complete on this process (a local view: no collective)."""
    return not self._chunks and all(out.is_ready() for _, out, _ in self._in_flight)

  @property
  def done(self) -> bool:
    """True once every chunk has been issued and handed to its sink."""
    return not self._chunks and not self._in_flight

  def _send_buffer(self, length: int) -> np.ndarray:
    # Reused once the chunk that used it has completed: writing into fresh pages costs more
    # than the copy itself on some hosts, and on CPU JAX may alias an aligned buffer.
    for i, buffer in enumerate(self._free):
      if buffer.nbytes == length:
        return self._free.pop(i)
    return local_read.aligned_empty(length)

  def _read_chunk(self, chunk: _Chunk) -> tuple[np.ndarray | jax.Array, bool]:
    """The bytes this process sends in `chunk` (the collective's input already where its
    stream's read-ahead made it), and whether the buffer is its own to reuse (a stream read
    ahead lends its own bytes, without a copy)."""
    sending = chunk.send is not None and chunk.offset < chunk.send.nbytes and \
        chunk.send not in self._broken
    if sending and chunk.send in self._viewers:
      view = self._viewers[chunk.send](chunk.offset, chunk.length)
      if view is not None:
        return view, False
    local = self._send_buffer(chunk.length)
    n = 0
    if sending:
      n = min(chunk.length, chunk.send.nbytes - chunk.offset)
      try:
        self._readers[chunk.send](chunk.offset, local[:n])
      except Exception as e:  # noqa: BLE001 - zeros go instead; agreed after the transfer
        self._fail(f"reading the stream to process {chunk.send.destination}", e)
        self._broken.add(chunk.send)
        n = 0
    local[n:] = 0
    return local, True

  def _issue(self, chunk: _Chunk) -> None:
    local, owned = self._read_chunk(chunk)
    if isinstance(local, jax.Array):
      global_in = local  # the collective's input, made ahead (`background_placer`)
    else:
      try:
        placed = place(local, node_mesh.devices_of(self._me))
      except Exception as e:  # noqa: BLE001 - the spare goes instead; agreed after the transfer
        self._fail(f"placing a chunk of {chunk.length} bytes", e)
        placed = _SPARES[chunk.length]
      global_in = node_mesh.split_input(placed)
    out = _permute_fn(chunk.pairs)(global_in)
    self._in_flight.append((chunk, out, local if owned else None))

  def _retire(self) -> None:
    chunk, out, local = self._in_flight.popleft()
    receive = chunk.receive
    try:
      # Over on every device before its send buffer is reused: each device reads its own
      # part, and a short tail's last part is not read below.
      out.block_until_ready()
    except Exception as e:  # noqa: BLE001 - e.g. a peer gone: agreed after the transfer
      self._fail("moving a chunk", e)
      if receive is not None:
        self._broken.add(receive)
      return
    if local is not None:
      self._free.append(local)
    if receive is None or chunk.offset >= receive.nbytes or receive in self._broken:
      return
    n = min(chunk.length, receive.nbytes - chunk.offset)
    try:
      received = node_mesh.local_parts(out, self._me)
      size = chunk.length // len(received)
      for start, part in zip(range(0, n, size), received, strict=False):  # n may be short
        data = np.asarray(part)
        self._sinks[receive](chunk.offset + start, data[:n - start])
    except Exception as e:  # noqa: BLE001 - the rest is dropped; agreed after the transfer
      self._fail(f"receiving the stream from process {receive.source}", e)
      self._broken.add(receive)

  def advance(self, max_chunks: int | None = None, *, window: int | None = None) -> None:
    """Issues up to `max_chunks` more chunks, keeping at most `window` in flight.

    Every process must call this with the same arguments at the same point of its program.
    Chunks that must complete to make room are handed to their sinks first.

    Args:
      max_chunks: How many chunks to issue at most; None issues all that remain.
      window: Most chunks in flight during this call (default: the transfer's window); a
        caller that leaves chunks running while training goes on allows more.
    """
    limit = self._window if window is None else max(1, window)
    issued = 0
    while self._chunks and (max_chunks is None or issued < max_chunks):
      if len(self._in_flight) >= limit:
        self._retire_waiting(len(self._in_flight) - limit + 1)
      self._issue(self._chunks.popleft())
      issued += 1

  def _retire_waiting(self, count: int) -> None:
    """Retires the oldest `count` chunks, waiting for them (timed: `waited_seconds`)."""
    started = time.perf_counter()
    try:
      for _ in range(min(count, len(self._in_flight))):
        self._retire()
    finally:
      self.waited_seconds += time.perf_counter() - started

  def retire_ready(self) -> None:
    """Hands the chunks that have already arrived to their sinks, in order, without waiting.

    JAX dispatches a chunk asynchronously (on CPU too), so a chunk issued at one `save()` is
    usually done by the next.
    """
    while self._in_flight and self._in_flight[0][1].is_ready():
      self._retire()

  def retire_finished(self) -> None:
    """Hands every chunk already issued to its sink (waits for them; issues nothing)."""
    self._retire_waiting(len(self._in_flight))

  def run(self) -> None:
    """Issues every remaining chunk and waits until all are handed to their sinks.

    Every process must call this at the same point of its program.
    """
    self.advance(None)
    self.retire_finished()
