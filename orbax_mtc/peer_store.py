"""Copies of other nodes' RAM checkpoints held on this node, and the byte streams that carry them.

Layout under this node's local directory::

  <local>/peers/<source_rank>/<step>/manifest.json   the source's manifest, verbatim
  <local>/peers/<source_rank>/<step>/copy.json       where each shard of it is held here
  <local>/peers/<source_rank>/<step>/data.bin        the stream as received (header + shards)
  <local>/peers/<source_rank>/.tmp-<step>-<id>/      a copy being received (never read)

A shard that this node already holds in its own folder of the same step (same array, same
index: a data-parallel twin's identical shard) is not sent; `copy.json` marks it -1 and serving
the copy reads it from the own folder. Checksums are the source's: whoever reads a copy checks
every shard before trusting it.

A stream is `[8-byte header length][JSON header][zero padding to 64][shards, each 64-aligned]`.
The same framing carries a whole step from a twin or a peer to a node that lost its folder.

File I/O only: no collectives, safe on the writer thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from orbax_mtc import local_tier

PEERS = "peers"
COPY_META = "copy.json"
COPY_FORMAT = "orbax-mtc/peer-copy/1"
STREAM_FORMAT = "orbax-mtc/stream/1"
_ALIGN = 64
_LEN = struct.Struct("<Q")


def _align(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


# ----------------------------------------------------------------------------- streams


@dataclasses.dataclass
class Segment:
  """`nbytes` of a stream at `offset`, taken from an in-memory buffer or from a file."""

  offset: int
  nbytes: int
  buffer: np.ndarray | None = None  # uint8
  path: Path | None = None
  file_offset: int = 0


@dataclasses.dataclass
class OutgoingStream:
  """A stream assembled on demand from segments (header, then shards)."""

  nbytes: int
  segments: list[Segment]

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
        else:
          assert seg.path is not None
          if seg.path not in fds:
            fds[seg.path] = os.open(seg.path, os.O_RDONLY)
          got = os.preadv(fds[seg.path], [memoryview(target)], seg.file_offset + lo - seg.offset)
          if got != hi - lo:
            raise local_tier.CorruptStepError(f"{seg.path}: short read while sending a copy")
    finally:
      for fd in fds.values():
        os.close(fd)


def stream_header(header: dict[str, Any]) -> tuple[np.ndarray, int]:
  """(framed header bytes, offset of the first shard)."""
  text = json.dumps(dict(header, format=STREAM_FORMAT)).encode()
  framed = np.frombuffer(_LEN.pack(len(text)) + text, dtype=np.uint8)
  return framed, _align(framed.nbytes)


def parse_stream_header(data: np.ndarray | bytes) -> tuple[dict[str, Any], int]:
  raw = memoryview(np.asarray(data, dtype=np.uint8)) if not isinstance(data, bytes) else data
  if len(raw) < _LEN.size:
    raise local_tier.CorruptStepError("stream shorter than its header")
  (length,) = _LEN.unpack(bytes(raw[:_LEN.size]))
  if length > len(raw) - _LEN.size:
    raise local_tier.CorruptStepError("stream header length is out of range")
  try:
    header = json.loads(bytes(raw[_LEN.size:_LEN.size + length]))
  except ValueError as e:
    raise local_tier.CorruptStepError(f"stream header is unreadable: {e}") from e
  if header.get("format") != STREAM_FORMAT:
    raise local_tier.CorruptStepError(f"unknown stream format {header.get('format')!r}")
  return header, _align(_LEN.size + length)


def copy_stream(step_dir: Path, manifest: local_tier.StepManifest, source: int,
                skip: Collection[int]) -> OutgoingStream:
  """The stream that gives a peer a copy of this node's committed step, minus `skip` ordinals
  (shards the peer already holds in its own folder of that step)."""
  entries = local_tier.manifest_entries(manifest)
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
  data_path = step_dir / local_tier.DATA
  for rel, shard in pending:
    segments.append(Segment(data_start + rel, shard.nbytes, path=data_path,
                            file_offset=shard.offset))
  return OutgoingStream(nbytes=data_start + offset, segments=segments)


def step_stream(manifest: local_tier.StepManifest, data: np.ndarray) -> OutgoingStream:
  """The stream that gives a node a whole step (manifest + data in manifest layout)."""
  framed, data_start = stream_header({"kind": "step", "manifest": manifest.to_json()})
  return OutgoingStream(nbytes=data_start + manifest.data_size, segments=[
      Segment(0, framed.nbytes, buffer=framed),
      Segment(data_start, manifest.data_size, buffer=data[:manifest.data_size])])


def received_step(buffer: np.ndarray) -> tuple[local_tier.StepManifest, np.ndarray]:
  """(manifest, data view) of a whole-step stream received into an aligned buffer."""
  header, data_start = parse_stream_header(buffer)
  if header.get("kind") != "step":
    raise local_tier.CorruptStepError(f"expected a step stream, got {header.get('kind')!r}")
  manifest = local_tier.StepManifest.from_json(header["manifest"])
  data = buffer[data_start:data_start + manifest.data_size]
  if data.nbytes != manifest.data_size:
    raise local_tier.CorruptStepError("step stream is shorter than its manifest says")
  return manifest, data


# ----------------------------------------------------------------------------- the store


@dataclasses.dataclass(frozen=True)
class CopyMeta:
  source: int
  step: int
  layout: tuple[int, ...]  # per manifest ordinal: absolute offset in data.bin, or -1 (own folder)

  @property
  def needs_own_step(self) -> bool:
    return any(x < 0 for x in self.layout)


class IncomingCopy:
  """A copy being received: chunks land in a temporary folder; `commit` makes it visible."""

  def __init__(self, store: PeerStore, source: int, step: int, nbytes: int):
    self._store = store
    self.source, self.step, self.nbytes = source, step, nbytes
    parent = store.source_dir(source)
    parent.mkdir(parents=True, exist_ok=True)
    self.tmp = parent / f"{local_tier.TMP_PREFIX}{step}-{uuid.uuid4().hex}"
    self.tmp.mkdir()
    self._fd = os.open(self.tmp / local_tier.DATA, os.O_RDWR | os.O_CREAT, 0o644)
    self.failed: BaseException | None = None
    self.received = 0  # bytes written; chunks never overlap, so == nbytes when complete

  def write(self, offset: int, data: np.ndarray) -> None:
    if self.failed is not None:
      return
    try:
      view = memoryview(np.ascontiguousarray(data))
      written = 0
      while written < len(view):
        written += os.pwrite(self._fd, view[written:], offset + written)
      self.received += written
    except OSError as e:
      self.failed = e

  def commit(self, keep_floor: int | None) -> Path | None:
    """Checks the header, writes manifest + layout, renames into place; None on failure."""
    try:
      if self.failed is not None:
        raise self.failed
      # A transfer cut short (an error on either side) must never commit a partial copy.
      if self.received != self.nbytes:
        raise local_tier.CorruptStepError(
            f"incomplete copy: {self.received} of {self.nbytes} bytes received")
      os.fsync(self._fd)
      head = os.pread(self._fd, 1 << 16, 0)
      (length,) = _LEN.unpack(head[:_LEN.size])
      if _LEN.size + length > len(head):
        head = os.pread(self._fd, _LEN.size + length, 0)
      header, data_start = parse_stream_header(head)
      if header.get("kind") != "copy" or header.get("source") != self.source \
          or header.get("step") != self.step:
        raise local_tier.CorruptStepError(
            f"stream for copy ({self.source}, {self.step}) carries "
            f"({header.get('source')}, {header.get('step')})")
      manifest = local_tier.StepManifest.from_json(header["manifest"])
      layout = [x if x < 0 else x + data_start for x in header["layout"]]
      if len(layout) != len(local_tier.manifest_entries(manifest)):
        raise local_tier.CorruptStepError("copy layout does not match its manifest")
      _write_file(self.tmp / local_tier.MANIFEST, manifest.to_json())
      _write_file(self.tmp / COPY_META, json.dumps(
          {"format": COPY_FORMAT, "source": self.source, "step": self.step, "layout": layout}))
      final = self._store.source_dir(self.source) / str(self.step)
      if final.exists():  # a re-sent copy (after a recovery) replaces the old one
        _remove(final)
      os.rename(self.tmp, final)
      local_tier.fsync_dir(final.parent)
    except (OSError, ValueError, KeyError, local_tier.LocalTierError) as e:
      logging.warning("orbax-mtc: copy of step %d from process %d not kept: %s", self.step,
                      self.source, e)
      _remove(self.tmp)
      return None
    finally:
      os.close(self._fd)
    self._store.apply_retention(self.source, keep_floor)
    return final

  def abort(self) -> None:
    """Drops a copy whose transfer failed (its temporary folder goes)."""
    try:
      os.close(self._fd)
    except OSError:
      pass
    _remove(self.tmp)


def _write_file(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.rename(tmp, path)


def _remove(path: Path) -> None:
  """Un-commits first (rename), then deletes: a half-deleted copy is never listed."""
  if not path.exists():
    return
  doomed = path.with_name(f"{local_tier.TMP_PREFIX}del-{uuid.uuid4().hex}")
  try:
    os.rename(path, doomed)
  except FileNotFoundError:
    return
  shutil.rmtree(doomed, ignore_errors=True)


class PeerStore:
  """`<local>/peers/`: copies of other nodes' steps held on this node."""

  def __init__(self, local_directory: Path, *, max_to_keep: int | None):
    self.root = Path(local_directory) / PEERS
    self.max_to_keep = max_to_keep

  def prepare(self) -> None:
    """Drops copies interrupted while being received."""
    if not self.root.is_dir():
      return
    for source in self.root.iterdir():
      if source.is_dir():
        for entry in source.iterdir():
          if entry.name.startswith(local_tier.TMP_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)

  def source_dir(self, source: int) -> Path:
    return self.root / str(int(source))

  def begin(self, source: int, step: int, nbytes: int) -> IncomingCopy:
    return IncomingCopy(self, source, step, nbytes)

  def copies(self) -> list[tuple[int, int]]:
    """Committed copies as (source, step), sorted."""
    out = []
    if not self.root.is_dir():
      return out
    for source in self.root.iterdir():
      if not source.name.isdigit() or not source.is_dir():
        continue
      for entry in source.iterdir():
        if entry.name.isdigit() and (entry / COPY_META).is_file() \
            and (entry / local_tier.MANIFEST).is_file():
          out.append((int(source.name), int(entry.name)))
    return sorted(out)

  def meta(self, source: int, step: int) -> CopyMeta:
    path = self.source_dir(source) / str(step) / COPY_META
    try:
      raw = json.loads(path.read_text())
      if raw.get("format") != COPY_FORMAT:
        raise ValueError(f"format {raw.get('format')!r}")
      return CopyMeta(int(raw["source"]), int(raw["step"]), tuple(int(x) for x in raw["layout"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise local_tier.LocalTierError(f"{path} is unreadable: {e}") from e

  def servable(self, own_steps: Collection[int]) -> list[tuple[int, int]]:
    """Copies this node can serve now: complete, or completed by its own folder of the step."""
    own = set(own_steps)
    out = []
    for source, step in self.copies():
      try:
        meta = self.meta(source, step)
      except local_tier.LocalTierError:
        continue
      if not meta.needs_own_step or step in own:
        out.append((source, step))
    return out

  def read(self, source: int, step: int, own_dir: Path) -> tuple[local_tier.StepManifest,
                                                                   np.ndarray]:
    """The source's step rebuilt in its own layout, every checksum verified."""
    folder = self.source_dir(source) / str(step)
    manifest = local_tier.read_manifest(folder)
    meta = self.meta(source, step)
    entries = local_tier.manifest_entries(manifest)
    if len(meta.layout) != len(entries):
      raise local_tier.CorruptStepError(f"{folder}: layout and manifest disagree")
    data = local_tier.aligned_empty(manifest.data_size)
    own_index: dict[tuple[str, str, Any], local_tier.ShardRecord] = {}
    own_path = own_dir / local_tier.DATA
    if meta.needs_own_step:
      own_manifest = local_tier.read_manifest(own_dir)
      own_index = {(name, leaf.path, shard.index): shard
                   for name, leaf, shard in local_tier.manifest_entries(own_manifest)}
    copy_fd = os.open(folder / local_tier.DATA, os.O_RDONLY)
    own_fd = os.open(own_path, os.O_RDONLY) if meta.needs_own_step else -1
    try:
      for (name, leaf, shard), at in zip(entries, meta.layout, strict=True):
        target = memoryview(data[shard.offset:shard.offset + shard.nbytes])
        if at >= 0:
          fd, offset, source_file = copy_fd, at, folder / local_tier.DATA
        else:
          mine = own_index.get((name, leaf.path, shard.index))
          if mine is None or mine.nbytes != shard.nbytes:
            raise local_tier.CorruptStepError(
                f"{folder}: shard {name}{leaf.path} {shard.index} is not in {own_dir}")
          fd, offset, source_file = own_fd, mine.offset, own_path
        got = os.preadv(fd, [target], offset)
        if got != shard.nbytes:
          raise local_tier.CorruptStepError(
              f"{folder}: short read of {name}{leaf.path} ({got} of {shard.nbytes} bytes at "
              f"{offset} of {source_file}, {os.fstat(fd).st_size} bytes)")
    finally:
      os.close(copy_fd)
      if own_fd >= 0:
        os.close(own_fd)
    local_tier.verify_buffer(data, manifest, f"copy of process {source} step {step} in {folder}")
    return manifest, data

  def apply_retention(self, source: int, keep_floor: int | None) -> None:
    """Keeps the newest `max_to_keep` copies of one source (and the common floor step)."""
    if self.max_to_keep is None:
      return
    steps = sorted(s for src, s in self.copies() if src == source)
    for step in steps[:max(0, len(steps) - self.max_to_keep)]:
      if step != keep_floor:
        _remove(self.source_dir(source) / str(step))

  def delete_step(self, step: int) -> None:
    for source, s in self.copies():
      if s == step:
        _remove(self.source_dir(source) / str(s))

  def drop_newer(self, step: int) -> None:
    """Removes copies of steps after `step` (a timeline the job abandoned on restore)."""
    for source, s in self.copies():
      if s > step:
        _remove(self.source_dir(source) / str(s))

  def drop_sources(self, keep: Sequence[int]) -> None:
    """Removes copies of nodes this node no longer holds copies for."""
    if not self.root.is_dir():
      return
    for source in self.root.iterdir():
      if source.name.isdigit() and int(source.name) not in set(keep):
        shutil.rmtree(source, ignore_errors=True)
