"""Copies of other nodes' RAM checkpoints held on this node.

Layout under this node's local directory::

  <local>/peers/<source_rank>/<step>/manifest.json   the source's manifest, verbatim
  <local>/peers/<source_rank>/<step>/copy.json       where each shard of it is held here
  <local>/peers/<source_rank>/<step>/data.bin        the stream as received (header + shards)
  <local>/peers/<source_rank>/.tmp-<step>-<id>/      a copy being received (never read)
  <local>/peers/<source_rank>/.spare-<id>/           a retired copy whose data file the
                                                     next copy from that source overwrites

A shard that this node already holds in its own folder of the same step (same array, same
index: a data-parallel twin's identical shard) is not sent; `copy.json` marks it -1 and serving
the copy reads it from the own folder. Checksums are the source's: whoever reads a copy checks
every shard before trusting it.

A copy arrives as a stream (peers/stream.py) and is kept as received.

File I/O only: no collectives, safe on the writer thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import reprlib
import shutil
import stat
import uuid
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from orbax_mtc import files
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import store as local_store
from orbax_mtc.peers.stream import LEN_PREFIX, check_layout, header_text, parse_stream_header

PEERS = "peers"
COPY_META = local_format.PEER_COPY_META
COPY_FORMAT = "orbax-mtc/peer-copy/1"


# ----------------------------------------------------------------------------- the store


@dataclasses.dataclass(frozen=True)
class CopyMeta:
  source: int
  step: int
  layout: tuple[int, ...]  # per manifest ordinal: absolute offset in data.bin, or -1 (own folder)

  @property
  def needs_own_step(self) -> bool:
    return any(x < 0 for x in self.layout)


@dataclasses.dataclass(frozen=True)
class ShardPlace:
  """Where one shard of a copy lies here: `offset` in the data file `path` (the copy's, or
  the own folder's for a shard the copy shares with it)."""

  shard: local_format.ShardRecord
  path: Path
  offset: int


class IncomingCopy:
  """A copy being received: chunks land in a temporary folder; `commit` makes it visible."""

  def __init__(self, store: PeerStore, source: int, step: int, nbytes: int):
    self._store = store
    self.source, self.step, self.nbytes = source, step, nbytes
    parent = store.make_source_dir(source)
    self.tmp = parent / f"{local_format.TMP_PREFIX}{step}-{uuid.uuid4().hex}"
    reused = _take_spare(parent, self.tmp)
    if not reused:
      files.make_private_dir(self.tmp, store.dir_mode, exist_ok=False)
    self._fd = os.open(self.tmp / local_format.DATA,
                       os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, store.file_mode)
    os.fchmod(self._fd, store.file_mode)  # whatever the umask
    if reused:  # every byte of it is written again; a longer old file is cut first
      os.ftruncate(self._fd, nbytes)
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
        raise local_format.CorruptStepError(
            f"incomplete copy: {self.received} of {self.nbytes} bytes received")
      manifest, layout, end = self._parse()
      if end < self.nbytes:  # planned longer than it was (peers/size_plan.py): zeros after
        os.ftruncate(self._fd, end)
      os.fsync(self._fd)
      file_mode = self._store.file_mode
      files.write_private_file(self.tmp / local_format.MANIFEST,
                                    manifest.to_json().encode(), file_mode)
      files.write_private_file(self.tmp / COPY_META, json.dumps(
          {"format": COPY_FORMAT, "source": self.source, "step": self.step,
           "layout": layout}).encode(), file_mode)
      files.fsync_dir(self.tmp)
      final = self._store.source_dir(self.source) / str(self.step)
      if os.path.lexists(final):  # a re-sent copy (after a recovery) replaces the old one...
        kept = _richer_copy(final, manifest)
        if kept:  # ... unless it holds less of the same save (rule 10)
          raise local_format.CorruptStepError(
              f"the copy held already has item(s) {kept} that the re-sent one lacks")
        _remove(final)
      os.rename(self.tmp, final)
      files.fsync_dir(final.parent)
    except (OSError, ValueError, KeyError, local_format.LocalTierError) as e:
      logging.warning("orbax-mtc: copy of step %d from process %d not kept: %s", self.step,
                      self.source, e)
      _remove(self.tmp)
      return None
    finally:
      os.close(self._fd)
    self._store.apply_retention(self.source, keep_floor)
    return final

  def _parse(self) -> tuple[local_format.StepManifest, list[int], int]:
    """(manifest, layout as absolute offsets, where the stream's last shard ends) of the
    received stream, checked against this copy; CorruptStepError / ManifestError for
    anything malformed."""
    where = f"copy of step {self.step} from process {self.source}"
    head = os.pread(self._fd, 1 << 16, 0)
    if len(head) < LEN_PREFIX.size:
      raise local_format.CorruptStepError(f"{where}: stream shorter than its header")
    (length,) = LEN_PREFIX.unpack(head[:LEN_PREFIX.size])
    if LEN_PREFIX.size + length > self.nbytes:
      raise local_format.CorruptStepError(f"{where}: stream header length is out of range")
    if LEN_PREFIX.size + length > len(head):
      head = os.pread(self._fd, LEN_PREFIX.size + length, 0)
    header, data_start = parse_stream_header(head)
    kind = header.get("kind")
    source = header.get("source")
    step = header.get("step")
    if kind != "copy" or type(source) is not int or source != self.source \
        or type(step) is not int or step != self.step:
      raise local_format.CorruptStepError(
          f"stream for copy ({self.source}, {self.step}) carries {reprlib.repr(kind)} "
          f"({reprlib.repr(source)}, {reprlib.repr(step)})")
    manifest = local_format.StepManifest.from_json(header_text(header, "manifest"),
                                                 where=f"manifest of the {where}")
    local_format.validate_for(manifest, where=f"manifest of the {where}", step=self.step,
                            process_index=self.source)
    layout = check_layout(header.get("layout"), manifest, data_start, self.nbytes, where)
    ends = [local_format.align(at + shard.nbytes) for at, (_, _, shard)
            in zip(layout, local_read.manifest_entries(manifest), strict=True) if at >= 0]
    return manifest, layout, max([data_start, *ends])

  def abort(self) -> None:
    """Drops a copy whose transfer failed (its temporary folder goes)."""
    try:
      os.close(self._fd)
    except OSError:
      pass
    _remove(self.tmp)


def _richer_copy(folder: Path, new: local_format.StepManifest) -> list[str]:
  """The items a held copy has beyond `new`, when both are the same save (process count and
  the shards of every item they share): a node whose step came back from a twin lacks its
  per-process items, and its re-sent copy must not replace the peer's copy that has them."""
  try:
    old = local_store.read_manifest(folder)
  except local_format.LocalTierError:
    return []
  extra = sorted(set(old.items) - set(new.items))
  if not extra or old.process_count != new.process_count:
    return []
  for name, item in new.items.items():
    held = old.items.get(name)
    if held is None or [(leaf.path, [s.index for s in leaf.shards]) for leaf in held.leaves] \
        != [(leaf.path, [s.index for s in leaf.shards]) for leaf in item.leaves]:
      return []
  return extra


def _remove(path: Path) -> None:
  """Un-commits first (rename), then deletes: a half-deleted copy is never listed."""
  files.remove_uncommitted_first(path, f"{local_format.TMP_PREFIX}del-")


def _retire(path: Path) -> None:
  """A copy retention no longer keeps: un-committed (renamed) into its source's spare when
  that has none, so that the next copy from the source overwrites its data file instead of
  never-touched memory (several times slower to write on some hosts, as the RAM tier's own
  spare); else removed. Removed too while a copy from the source is being received (it did
  not find the spare: kept, it would hold a step's worth of RAM more than before)."""
  parent = path.parent
  if path.is_symlink() or not path.is_dir() or any(
      e.name.startswith((local_format.SPARE_PREFIX, local_format.TMP_PREFIX))
      for e in parent.iterdir()):
    _remove(path)
    return
  try:
    os.rename(path, parent / f"{local_format.SPARE_PREFIX}{uuid.uuid4().hex}")
  except FileNotFoundError:
    return


def _take_spare(parent: Path, tmp: Path) -> bool:
  """Moves a spare of `parent` to `tmp` with its data file alone; whether there was one."""
  for entry in parent.iterdir():
    if not entry.name.startswith(local_format.SPARE_PREFIX) or not _is_real_dir(entry):
      continue
    try:
      os.rename(entry, tmp)
    except FileNotFoundError:  # taken meanwhile
      continue
    for item in tmp.iterdir():
      if item.name == local_format.DATA and item.is_file() and not item.is_symlink():
        continue
      if _is_real_dir(item):
        shutil.rmtree(item, ignore_errors=True)
      else:
        item.unlink()
    return True
  return False


def _is_real_dir(path: Path) -> bool:
  return not path.is_symlink() and path.is_dir()


class PeerStore:
  """`<local>/peers/`: copies of other nodes' steps held on this node.

  Folders are created with `dir_mode`, files with `file_mode`; links named like a source or a
  step are never followed.
  """

  def __init__(self, local_directory: Path, *, max_to_keep: int | None,
               keep: Callable[[Sequence[int], int | None], set[int]] | None = None,
               dir_mode: int = 0o700, file_mode: int = 0o600):
    self.root = Path(local_directory) / PEERS
    self.max_to_keep = max_to_keep
    self.keep = keep  # as LocalTier
    self.dir_mode = dir_mode
    self.file_mode = file_mode

  def prepare(self) -> None:
    """Drops copies interrupted while being received (spares are kept)."""
    if not _is_real_dir(self.root):
      return
    for source in self.root.iterdir():
      if _is_real_dir(source):
        for entry in source.iterdir():
          if entry.name.startswith(local_format.TMP_PREFIX):
            _remove(entry)

  def source_dir(self, source: int) -> Path:
    return self.root / str(int(source))

  def make_source_dir(self, source: int) -> Path:
    """The folder of `source`'s copies, created (with `dir_mode`) where missing. A link in
    its place is removed: only this store writes there."""
    folder = self.source_dir(source)
    self.root.parent.mkdir(parents=True, exist_ok=True)
    for path in (self.root, folder):
      if path.is_symlink():
        logging.warning("orbax-mtc: removing %s: a symbolic link where peer copies belong", path)
        path.unlink()
      files.make_private_dir(path, self.dir_mode)
    return folder

  def begin(self, source: int, step: int, nbytes: int) -> IncomingCopy:
    return IncomingCopy(self, source, step, nbytes)

  def copies(self) -> list[tuple[int, int]]:
    """Committed copies as (source, step), sorted; links are skipped, never followed."""
    out: list[tuple[int, int]] = []
    if not _is_real_dir(self.root):
      return out
    for source in self.root.iterdir():
      if not local_store.is_step_name(source.name) or not _is_real_dir(source):
        continue
      for entry in source.iterdir():
        if not local_store.is_step_name(entry.name):
          continue
        if entry.is_symlink():
          local_store.warn_link_skipped(str(entry))
          continue
        if entry.is_dir() and _is_regular(entry / COPY_META) \
            and _is_regular(entry / local_format.MANIFEST):
          out.append((int(source.name), int(entry.name)))
    return sorted(out)

  def meta(self, source: int, step: int) -> CopyMeta:
    """The checked copy record of a committed copy; LocalTierError if unusable."""
    folder = self.source_dir(source) / str(step)
    path = folder / COPY_META
    try:
      raw = json.loads(local_store.read_step_file(folder, COPY_META))
    except (OSError, ValueError, RecursionError) as e:
      raise local_format.LocalTierError(f"{path} is unreadable: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != COPY_FORMAT:
      raise local_format.LocalTierError(f"{path} is not a copy record of format {COPY_FORMAT!r}")
    for key, want in (("source", source), ("step", step)):
      if type(raw.get(key)) is not int or raw[key] != want:
        raise local_format.LocalTierError(
            f"{path}: field {key!r} holds {reprlib.repr(raw.get(key))}, expected {want}")
    layout = raw.get("layout")
    if not isinstance(layout, list) or any(type(x) is not int or x < -1 for x in layout):
      raise local_format.LocalTierError(
          f"{path}: field 'layout' holds {reprlib.repr(layout)}, expected a list of offsets "
          "or -1")
    return CopyMeta(source, step, tuple(layout))

  def servable(self, own_steps: Collection[int]) -> list[tuple[int, int]]:
    """Copies this node can serve now: complete, or completed by its own folder of the step."""
    own = set(own_steps)
    out = []
    for source, step in self.copies():
      try:
        meta = self.meta(source, step)
      except local_format.LocalTierError:
        continue
      if not meta.needs_own_step or step in own:
        out.append((source, step))
    return out

  def locate(self, source: int, step: int, own_dir: Path
             ) -> tuple[local_format.StepManifest, list[ShardPlace]]:
    """Where each shard of the source's step lies here (in manifest order), every place
    checked against the size of the file that backs it; nothing read but metadata.

    LocalTierError (CorruptStepError, ManifestError) for anything missing or malformed.
    """
    folder = self.source_dir(source) / str(step)
    manifest = local_store.read_manifest(folder)
    local_format.validate_for(manifest, where=str(folder / local_format.MANIFEST),
                            process_index=source)
    meta = self.meta(source, step)
    entries = local_read.manifest_entries(manifest)
    if len(meta.layout) != len(entries):
      raise local_format.CorruptStepError(f"{folder}: layout and manifest disagree")
    own_index: dict[tuple[str, str, Any], local_format.ShardRecord] = {}
    own_path = own_dir / local_format.DATA
    copy_path = folder / local_format.DATA
    copy_size = _file_size(folder)
    if meta.needs_own_step:
      own_manifest = local_store.read_manifest(own_dir)  # its data file holds every shard
      own_index = {(name, leaf.path, shard.index): shard
                   for name, leaf, shard in local_read.manifest_entries(own_manifest)}
      own_size = _file_size(own_dir)
    places = []
    # Every shard's source is checked before a reader allocates: a manifest cannot make this
    # node allocate (or send) more than the bytes that back it.
    for (name, leaf, shard), at in zip(entries, meta.layout, strict=True):
      if at >= 0:
        if at + shard.nbytes > copy_size:
          raise local_format.CorruptStepError(
              f"{folder}: shard {name}{leaf.path} {shard.index} lies beyond the "
              f"{copy_size} bytes of {copy_path}")
        places.append(ShardPlace(shard, copy_path, at))
      else:
        mine = own_index.get((name, leaf.path, shard.index))
        if mine is None or mine.nbytes != shard.nbytes or \
            mine.offset + mine.nbytes > own_size:
          raise local_format.CorruptStepError(
              f"{folder}: shard {name}{leaf.path} {shard.index} is not in {own_dir}")
        places.append(ShardPlace(shard, own_path, mine.offset))
    return manifest, places

  def read(self, source: int, step: int, own_dir: Path) -> tuple[local_format.StepManifest,
                                                                   np.ndarray]:
    """The source's step rebuilt in its own layout, every checksum verified.

    LocalTierError (CorruptStepError, ManifestError) for anything missing or malformed.
    """
    manifest, places = self.locate(source, step, own_dir)
    folder = self.source_dir(source) / str(step)
    fds: dict[Path, int] = {}
    try:
      data = local_read.aligned_empty(manifest.data_size)
      for place in places:
        if place.path not in fds:
          try:
            fds[place.path] = local_store.open_step_file(place.path.parent, place.path.name)
          except OSError as e:
            raise local_format.LocalTierError(f"{place.path}: {e}") from e
        shard = place.shard
        target = memoryview(data[shard.offset:shard.offset + shard.nbytes])
        got = os.preadv(fds[place.path], [target], place.offset)
        if got != shard.nbytes:
          raise local_format.CorruptStepError(
              f"{folder}: short read of a shard ({got} of {shard.nbytes} bytes at "
              f"{place.offset} of {place.path})")
    finally:
      for fd in fds.values():
        os.close(fd)
    local_read.verify_buffer(data, manifest, f"copy of process {source} step {step} in {folder}")
    return manifest, data

  def apply_retention(self, source: int, keep_floor: int | None) -> None:
    """Keeps the newest `max_to_keep` copies of one source (and the common floor step), or
    what `keep` keeps."""
    steps = sorted(s for src, s in self.copies() if src == source)
    if self.keep is not None:
      kept = self.keep(steps, keep_floor)
      for step in steps:
        if step not in kept:
          _retire(self.source_dir(source) / str(step))
      return
    if self.max_to_keep is None:
      return
    for step in steps[:max(0, len(steps) - self.max_to_keep)]:
      if step != keep_floor:
        _retire(self.source_dir(source) / str(step))

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
    if not _is_real_dir(self.root):
      return
    for source in self.root.iterdir():
      if local_store.is_step_name(source.name) and int(source.name) not in set(keep):
        _remove(source)

  def drop_other_counts(self, process_count: int) -> None:
    """Removes every copy saved by a job of another process count."""
    for source, step in self.copies():
      folder = self.source_dir(source) / str(step)
      if self.saved_count(folder) != process_count:
        _remove(folder)

  @staticmethod
  def saved_count(folder: Path) -> int | None:
    """The process count a copy was saved with; None when it is no readable copy."""
    if not local_store.is_step_name(folder.name):
      return None
    try:
      return local_store.read_manifest(folder).process_count
    except local_format.LocalTierError:
      return None


def _file_size(step_dir: Path) -> int:
  """The size of `step_dir`'s data file (LocalTierError when it cannot be opened)."""
  try:
    fd = local_store.open_step_file(step_dir, local_format.DATA)
  except OSError as e:
    raise local_format.LocalTierError(f"{step_dir / local_format.DATA}: {e}") from e
  try:
    return os.fstat(fd).st_size
  finally:
    os.close(fd)


def _is_regular(path: Path) -> bool:
  try:
    return stat.S_ISREG(os.lstat(path).st_mode)
  except OSError:
    return False
