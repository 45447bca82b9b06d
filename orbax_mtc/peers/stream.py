"""The byte streams that carry a RAM step between nodes.

A stream is `[8-byte header length][JSON header][zero padding to 64][shards, each 64-aligned]`.
The header names the source, the step's manifest and where each shard lies. A peer copy is
such a stream of the shards the receiver does not hold itself (peers/copy_store.py keeps it as
received); the same framing carries a whole step from a twin or a peer to a node that lost
its folder (restore/executor.py).

File I/O only: no collectives, safe on the writer thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import reprlib
import struct
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read

STREAM_FORMAT = "orbax-mtc/stream/1"
_ALIGN = 64
LEN_PREFIX = struct.Struct("<Q")


def _align(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


@dataclasses.dataclass
class Segment:
  """`nbytes` of a stream at `offset`, taken from an in-memory buffer or from a file."""

  offset: int
  nbytes: int
  buffer: np.ndarray | None = None  # uint8
  path: Path | None = None
  file_offset: int = 0
  tag: Any = None  # what the bytes belong to, named in `OutgoingStream.failures`


@dataclasses.dataclass
class OutgoingStream:
  """A stream assembled on demand from segments (header, then shards).

  With `failures` a list, a file segment that cannot be read is sent as zeros and the error
  is kept there with the segment's tag, instead of raising between two chunks of a transfer
  (where the receiving process would be left inside the collective): the receiver's
  checksums reject the bytes, and the sender reports the error at the next agreement.
  """

  nbytes: int
  segments: list[Segment]
  failures: list[tuple[Any, Exception]] | None = None
  # Chunks read ahead on a background thread (`read_ahead`): offset -> the future of the
  # read (its buffer, and that buffer placed for sending or None).
  _ahead: dict[int, concurrent.futures.Future] = dataclasses.field(default_factory=dict)
  _ahead_state: tuple[int, int, Callable[..., concurrent.futures.Future],
                      Callable[[np.ndarray], Any] | None] | None = None
  _ahead_next: int = 0  # the first offset not yet asked of the background thread

  def read_ahead(self, chunk_bytes: int, budget_bytes: int,
                 submit: Callable[..., concurrent.futures.Future],
                 place: Callable[[np.ndarray], Any] | None = None) -> None:
    """Starts reading the stream in `chunk_bytes` chunks through `submit` (a background
    thread: file I/O only), at most `budget_bytes` of them read and not yet taken by `view`,
    so that sending does not read the RAM disk on the main thread and a step of any size
    holds a bounded amount of memory. With `place`, the same thread also places each chunk
    for sending (`view` then hands out what it returned; a chunk it fails on goes unplaced)."""
    self._ahead_state = (max(1, chunk_bytes), max(1, budget_bytes), submit, place)
    self._fill()

  def _fill(self) -> None:
    if self._ahead_state is None:
      return
    chunk, budget, submit, place = self._ahead_state
    while self._ahead_next < self.nbytes and (len(self._ahead) + 1) * chunk <= max(budget,
                                                                                   chunk):
      offset = self._ahead_next
      self._ahead[offset] = submit(self._read_ahead_chunk, offset, chunk, place)
      self._ahead_next += chunk

  def _read_ahead_chunk(self, offset: int, length: int,
                        place: Callable[[np.ndarray], Any] | None) -> tuple[np.ndarray, Any]:
    buffer = self._read_chunk(offset, length)
    if place is None:
      return buffer, None
    try:
      return buffer, place(buffer)
    except Exception:  # noqa: BLE001 - the sender places the bytes itself (and reports)
      return buffer, None

  def _read_chunk(self, offset: int, length: int) -> np.ndarray:
    """Stream bytes [offset, offset + length) in a fresh aligned buffer, the gaps between
    segments and the tail past the stream's end as zeros."""
    buffer = local_read.aligned_empty(length, align=4096)
    stop = min(self.nbytes, offset + length)
    self.read(offset, buffer[:stop - offset])
    at = offset  # the alignment gaps as zeros, not whatever memory held before
    for seg in sorted(self.segments, key=lambda seg: seg.offset):
      lo, hi = max(offset, seg.offset), min(stop, seg.offset + seg.nbytes)
      if lo >= hi:
        continue
      buffer[at - offset:lo - offset] = 0
      at = hi
    buffer[at - offset:] = 0
    return buffer

  def view(self, offset: int, nbytes: int) -> Any:
    """Stream bytes [offset, offset + nbytes), past the end as zeros, from a chunk read
    ahead: as placed by `read_ahead`'s `place` when that placed exactly these bytes, else a
    uint8 view of its buffer. None when no read-ahead chunk starts at `offset` and covers
    them, or its read failed or has not started (the caller then `read`s them itself)."""
    future = self._ahead.pop(offset, None)
    if future is None:
      return None
    # Not started yet (queued behind other work of the thread): cheaper to read here than
    # to wait for the thread's queue.
    taken = None if future.cancel() or future.exception() is not None else future.result()
    self._fill()
    if taken is None or nbytes > taken[0].nbytes:
      return None
    buffer, placed = taken
    if placed is not None and nbytes == buffer.nbytes:
      return placed
    return buffer[:nbytes]

  def cancel_read_ahead(self) -> None:
    """Drops the reads not yet taken (the transfer ended or was dropped)."""
    self._ahead_state = None
    for future in self._ahead.values():
      future.cancel()
    self._ahead.clear()

  def read(self, offset: int, out: np.ndarray) -> None:
    """Fills `out` with stream bytes [offset, offset + out.nbytes); gaps stay as they are."""
    stop = offset + out.nbytes
    fds: dict[Path, int] = {}
    try:
      for seg in self.segments:
        lo, hi = max(offset, seg.offset), min(stop, seg.offset + seg.nbytes)
        if lo >= hi:
          continue
        target = out[lo - offset:hi - offset]
        if seg.buffer is not None:
          target[:] = seg.buffer[lo - seg.offset:hi - seg.offset]
          continue
        try:
          self._read_file(seg, fds, target, seg.file_offset + lo - seg.offset)
        except (OSError, local_format.LocalTierError) as e:
          if self.failures is None:
            raise
          target[:] = 0
          if not any(tag == seg.tag for tag, _ in self.failures):
            self.failures.append((seg.tag, e))
    finally:
      for fd in fds.values():
        os.close(fd)

  @staticmethod
  def _read_file(seg: Segment, fds: dict[Path, int], target: np.ndarray, at: int) -> None:
    assert seg.path is not None
    if seg.path not in fds:
      fds[seg.path] = os.open(seg.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    got = os.preadv(fds[seg.path], [memoryview(target)], at)
    if got != target.nbytes:
      raise local_format.CorruptStepError(f"{seg.path}: short read while sending a copy")


def stream_header(header: dict[str, Any]) -> tuple[np.ndarray, int]:
  """(framed header bytes, offset of the first shard)."""
  text = json.dumps(dict(header, format=STREAM_FORMAT)).encode()
  framed = np.frombuffer(LEN_PREFIX.pack(len(text)) + text, dtype=np.uint8)
  return framed, _align(framed.nbytes)


def parse_stream_header(data: np.ndarray | bytes) -> tuple[dict[str, Any], int]:
  """(header, offset of the first shard); CorruptStepError for anything malformed."""
  raw = memoryview(np.asarray(data, dtype=np.uint8)) if not isinstance(data, bytes) else data
  if len(raw) < LEN_PREFIX.size:
    raise local_format.CorruptStepError("stream shorter than its header")
  (length,) = LEN_PREFIX.unpack(bytes(raw[:LEN_PREFIX.size]))
  if length > len(raw) - LEN_PREFIX.size:
    raise local_format.CorruptStepError("stream header length is out of range")
  try:
    header = json.loads(bytes(raw[LEN_PREFIX.size:LEN_PREFIX.size + length]))
  except (ValueError, RecursionError) as e:
    raise local_format.CorruptStepError(f"stream header is unreadable: {e}") from e
  if not isinstance(header, dict):
    raise local_format.CorruptStepError(f"stream header is {type(header).__name__}, not an object")
  if header.get("format") != STREAM_FORMAT:
    raise local_format.CorruptStepError(
        f"unknown stream format {reprlib.repr(header.get('format'))}")
  return header, _align(LEN_PREFIX.size + length)


def header_text(header: dict[str, Any], key: str) -> str:
  """A string field of a stream header; CorruptStepError when missing or not a string."""
  value = header.get(key)
  if not isinstance(value, str):
    raise local_format.CorruptStepError(
        f"stream header field {key!r} holds {reprlib.repr(value)}, expected a string")
  return value


def check_layout(layout: Any, manifest: local_format.StepManifest, data_start: int,
                  stream_size: int, where: str) -> list[int]:
  """The layout of a copy as absolute offsets in its data file (-1: in the holder's own
  folder), each shard sent lying within the `stream_size` bytes; CorruptStepError if not."""
  entries = local_read.manifest_entries(manifest)
  if not isinstance(layout, list) or len(layout) != len(entries):
    raise local_format.CorruptStepError(f"{where}: copy layout does not match its manifest")
  out = []
  for at, (name, leaf, shard) in zip(layout, entries, strict=True):
    if type(at) is not int or at < -1:
      raise local_format.CorruptStepError(
          f"{where}: layout entry of {name}{leaf.path} holds {reprlib.repr(at)}, expected -1 "
          "or an offset")
    if at >= 0:
      at += data_start
      if at + shard.nbytes > stream_size:
        raise local_format.CorruptStepError(
            f"{where}: shard {name}{leaf.path} {shard.index} lies beyond the {stream_size} "
            "bytes received")
    out.append(at)
  return out


def copy_stream(step_dir: Path, manifest: local_format.StepManifest, source: int,
                skip: Collection[int]) -> OutgoingStream:
  """The stream that gives a peer a copy of this node's committed step, minus `skip` ordinals
  (shards the peer already holds in its own folder of that step)."""
  entries = local_read.manifest_entries(manifest)
  layout: list[int] = []
  pending = []
  offset = 0
  for ordinal, (_, _, shard) in enumerate(entries):
    if ordinal in skip:
      layout.append(-1)
      continue
    layout.append(offset)  # relative to the data start; made absolute below
    pending.append((offset, shard))
    offset = _align(offset + shard.nbytes)
  framed, data_start = stream_header({
      "kind": "copy", "source": source, "step": manifest.step,
      "manifest": manifest.to_json(), "layout": layout})
  # Offsets in the header are relative to the data start, so the header need not know its size.
  segments = [Segment(0, framed.nbytes, buffer=framed)]
  data_path = step_dir / local_format.DATA
  for rel, shard in pending:
    segments.append(Segment(data_start + rel, shard.nbytes, path=data_path,
                            file_offset=shard.offset))
  return OutgoingStream(nbytes=data_start + offset, segments=segments)


