"""This node's RAM-disk step folders: write, commit, list, retire (the layout is `format`'s).

A step folder only ever appears by renaming a complete temporary folder, so a process killed
at any instant leaves either the whole step or nothing restore would pick. A save writes
data.bin into `.tmp-<step>-<id>/` (a spare's folder when there is one) while a second thread
checksums the staged bytes, then manifest.json (under a temporary name, renamed), flushes the
folder and renames it to `<step>`: the commit point. Files of the step that retention retires
are overwritten in place by the next save: on tmpfs overwriting pages that already exist is
about twice as fast as writing a new file. The weights are private: folders are created 0700
and files 0600 (by default), and a step-named symbolic link is never followed.

This module does file I/O only. It never issues a collective, so its writer runs safely in a
background thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import logging

from orbax_mtc.files import check_owner, fsync_dir, make_private_dir, write_atomic
from orbax_mtc.local import aside, checksum, data_write, priority
from orbax_mtc.local.format import (
  DATA,
  MANIFEST,
  PEER_COPY_META,
  SPARE_PREFIX,
  TMP_PREFIX,
  CorruptStepError,
  LeafRecord,
  LocalTierError,
  ManifestError,
  ShardRecord,
  StepManifest,
  validate_for,
)
from orbax_mtc.local.saved_counts import SavedCounts
from orbax_mtc.local.staging import HostPool, StagedStep


def is_step_name(name: str) -> bool:
  """A committed step folder's name: ASCII decimal digits only (not "²" or "٣")."""
  return name.isascii() and name.isdigit()


_warned_links: set[str] = set()


def warn_link_skipped(path: str) -> None:
  """Logs, once per path, that a step-named symbolic link was skipped."""
  if path not in _warned_links:
    _warned_links.add(path)
    logging.warning("orbax-mtc: ignoring %s: a step-named symbolic link (step folders are "
                    "never followed out of the local directory)", path)


def open_step_file(step_dir: Path, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
  """A file descriptor for `step_dir/name`, following no symbolic link on the way.

  Args:
    step_dir: the step folder.
    name: the file's name in it.
    flags: `os.open` flags (O_NOFOLLOW and O_CLOEXEC are added).
    mode: permission bits of a file this creates.

  Returns:
    The open descriptor; the caller closes it.

  Raises:
    LocalTierError: the step folder is a link, missing, or not a folder.
    OSError: from opening the file (FileNotFoundError, or ELOOP for a linked file).
  """
  if os.path.islink(step_dir):
    raise LocalTierError(f"{step_dir} is a symbolic link: step folders are never followed")
  try:
    dir_fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
  except FileNotFoundError as e:
    raise LocalTierError(f"{step_dir} does not exist: not a committed step") from e
  except NotADirectoryError as e:
    raise LocalTierError(f"{step_dir} is not a folder") from e
  except OSError as e:
    if e.errno == errno.ELOOP:  # became a link since the check above
      raise LocalTierError(f"{step_dir} is a symbolic link: step folders are never followed") \
          from e
    raise
  try:
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
  finally:
    os.close(dir_fd)


def open_regular_file(step_dir: Path, name: str) -> int:
  """`open_step_file` for reading a regular file.

  Raises:
    LocalTierError: the file is a link or not a regular file (or as `open_step_file`).
    OSError: from opening the file (FileNotFoundError...).
  """
  try:
    fd = open_step_file(step_dir, name)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise LocalTierError(f"{step_dir / name} is a symbolic link: refused") from e
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise LocalTierError(f"{step_dir / name} is not a regular file")
  return fd


def read_step_file(step_dir: Path, name: str) -> bytes:
  """The bytes of a small file of a step folder (manifest, copy record), links refused.

  Raises:
    LocalTierError: as `open_regular_file`.
    OSError: from opening or reading the file.
  """
  fd = open_regular_file(step_dir, name)
  try:
    with os.fdopen(fd, "rb", closefd=False) as f:
      return f.read()
  finally:
    os.close(fd)


def read_manifest(step_dir: Path, *, process_index: int | None = None,
                  process_count: int | None = None) -> StepManifest:
  """The manifest of a committed step folder, checked against the folder.

  Beyond the checks of `StepManifest.from_json`: the folder is no symbolic link, its name is
  the manifest's step, its data file holds at least `data_size` bytes (a peer copy's data
  file, a stream, is checked by peer_store instead) and, when given, the process index and
  count match.

  Args:
    step_dir: the step folder.
    process_index: the reading process's index, or None to accept any.
    process_count: the job's process count, or None to accept any.

  Returns:
    The manifest.

  Raises:
    LocalTierError: on any problem (ManifestError, CorruptStepError among them).
  """
  step_dir = Path(step_dir)
  path = step_dir / MANIFEST
  if not is_step_name(step_dir.name):
    raise ManifestError(f"{path}: folder name {step_dir.name!r} is not a step number")
  try:
    raw = read_step_file(step_dir, MANIFEST)
  except FileNotFoundError as e:
    raise LocalTierError(f"{step_dir} has no {MANIFEST}: not a committed step") from e
  except OSError as e:
    raise LocalTierError(f"{path}: {e}") from e
  manifest = StepManifest.from_json(raw, where=str(path))
  data_size = None
  if not os.path.lexists(step_dir / PEER_COPY_META):
    try:
      fd = open_regular_file(step_dir, DATA)
    except FileNotFoundError as e:
      raise LocalTierError(f"{step_dir} has no {DATA}: not a committed step") from e
    except OSError as e:
      raise LocalTierError(f"{step_dir / DATA}: {e}") from e
    try:
      data_size = os.fstat(fd).st_size
    finally:
      os.close(fd)
  validate_for(manifest, where=str(path), step=int(step_dir.name), process_index=process_index,
               process_count=process_count, data_file_size=data_size)
  return manifest


def committed_steps(root: Path) -> list[int]:
  """The committed steps in a local directory.

  Args:
    root: the local directory (it may be missing).

  Returns:
    Steps with a committed folder (a real folder, not a link, with a manifest), oldest first.
  """
  if not root.is_dir():
    return []
  steps = []
  with os.scandir(root) as entries:
    for entry in entries:
      if not is_step_name(entry.name):
        continue
      if entry.is_symlink():
        warn_link_skipped(entry.path)
        continue
      try:
        is_committed = entry.is_dir(follow_symlinks=False) and stat.S_ISREG(
            os.lstat(os.path.join(entry.path, MANIFEST)).st_mode)
      except OSError:  # no manifest, or the folder went away meanwhile
        continue
      if is_committed:
        steps.append(int(entry.name))
  return sorted(steps)


def _crc_staged(staged: StagedStep, ranges: Sequence[tuple[int, int]]) -> list[int]:
  return [checksum.crc(staged.bytes_at(offset, nbytes)) for offset, nbytes in ranges]


class LocalTier:
  """This node's RAM-disk step folders: write, commit, list, retire (`read` reads them).

  Model weights are private: folders are created with `dir_mode`, files with `file_mode`
  (whatever the umask), and a local directory owned by another user is refused.

  Args:
    directory: this process's local directory, on the RAM disk.
    max_to_keep: committed steps kept (besides `keep_floor`, `keep_replicated`,
      `keep_sending`); None: all.
    on_commit: called by `write` with the newest committed step.
    keep: `keep(steps, floor)`, the steps kept, when retention follows a policy
      (ram_retention.py); else the newest `max_to_keep`.
    reuse_files: whether a retired step's data file is overwritten by the next save.
    process_index: when given, `manifest` checks it.
    process_count: when given, `manifest` checks it.
    dir_mode: permission bits of the folders this creates.
    file_mode: permission bits of the files this writes.
    write_threads: threads that write a step's data at once (None: by the host's cores,
      data_write.default_threads).
    nice_increment: how much lower the CPU priority of the threads that checksum and write
      a step is than the process's (priority.py).
  """

  def __init__(self, directory: Path, *, max_to_keep: int | None,
               on_commit: Callable[[int], None] | None = None,
               keep: Callable[[Sequence[int], int | None], set[int]] | None = None,
               reuse_files: bool = True,
               process_index: int | None = None, process_count: int | None = None,
               dir_mode: int = 0o700, file_mode: int = 0o600,
               write_threads: int | None = None, nice_increment: int = 0):
    self.directory = Path(directory)
    self.max_to_keep = max_to_keep
    self.keep = keep
    self._on_commit = on_commit
    self.reuse_files = reuse_files  # False: another program may still copy a retired step
    self.process_index = process_index
    self.process_count = process_count
    self.dir_mode = dir_mode
    self.file_mode = file_mode
    # Newest step that every process had committed at the last save: kept even beyond
    # max_to_keep, so a crash between two nodes' commits still leaves a common RAM step.
    self.keep_floor: int | None = None
    self.keep_replicated: int | None = None  # newest step whose peer copies landed: kept too
    self.keep_sending: int | None = None  # the step whose peer copies are going out: kept too
    self.spares = 1  # retired steps kept for the next writes to reuse (their pages)
    self.saved_counts = SavedCounts(self.directory, process_count, read_manifest)  # whose saves
    self._lock = threading.Lock()  # guards folder renames between writer and main thread
    lowered = priority.initializer(nice_increment)
    self._crc_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtc-crc",
                                                           initializer=lowered)
    # Threads that write a step's data with the writer thread (data_write.default_threads).
    self.write_threads = (data_write.default_threads() if write_threads is None
                          else max(1, write_threads))
    self._write_pool = concurrent.futures.ThreadPoolExecutor(
        self.write_threads - 1, thread_name_prefix="mtc-write", initializer=lowered) \
        if self.write_threads > 1 else None
    self._host_pool = HostPool()  # what borrowed pieces are copied into (writer thread)

  # -- set-up

  def prepare(self) -> None:
    """Creates the directory and drops leftovers (interrupted saves, extra spares).

    Raises:
      ValueError: the directory cannot be used (not a folder, not creatable or writable,
        owned by another user); the message says how to fix it.
    """
    root = self.directory
    if root.exists() and not root.is_dir():
      raise ValueError(
          f"local_directory {root} exists and is not a directory. Point local_directory at a "
          "folder on the RAM disk (e.g. /dev/shm/ckpt) or remove the file.")
    try:
      root.parent.mkdir(parents=True, exist_ok=True)
      created = make_private_dir(root, self.dir_mode)
    except OSError as e:
      raise ValueError(f"Cannot create local_directory {root}: {e.strerror}. Choose a writable "
                       "folder on the RAM disk (e.g. /dev/shm/ckpt).") from e
    check_owner(root, "local_directory")
    if not os.access(root, os.W_OK | os.X_OK):
      raise ValueError(f"local_directory {root} is not writable by this process (uid "
                       f"{os.getuid()}). Fix its permissions or choose another folder.")
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if not created and mode & ~self.dir_mode & 0o077:
      logging.warning("orbax-mtc: local_directory %s has mode %o: other users may read the "
                      "saved weights (chmod %o %s to prevent it)", root, mode, self.dir_mode,
                      root)
    spares = []
    for entry in root.iterdir():
      if entry.name.startswith((TMP_PREFIX, SPARE_PREFIX)) and entry.is_symlink():
        entry.unlink()  # never ours: removing the link touches nothing it points to
      elif entry.name.startswith(TMP_PREFIX):
        logging.info("orbax-mtc: removing interrupted local save %s", entry)
        shutil.rmtree(entry, ignore_errors=True)
      elif entry.name.startswith(SPARE_PREFIX):
        spares.append(entry)
    for extra in spares[1:]:
      shutil.rmtree(extra, ignore_errors=True)
    aside.recover(root)

  # -- writing (background thread: file I/O only)

  def write(self, staged: StagedStep, process_index: int, process_count: int, *,
            replace: str | None = None) -> Path:
    """Writes and commits one staged step, applies retention, then calls `on_commit` with
    the newest committed step.

    A folder of the step that is no valid step (no manifest, say) is moved aside as damaged
    at the commit instant, never left to block it. A valid one is kept and FileExistsError
    raised, unless `replace` says how to set it aside (`aside.REPLACED`: an older layout an
    elastic restore may still read; `aside.DAMAGED`: a copy restore found unusable).

    `on_commit` gets the newest step, not necessarily `staged.step`: a forced save of a step
    older than those kept is retired again at once, and whatever `on_commit` points at it
    (the LKG link) must not dangle.

    Args:
      staged: the step, from `staging.stage` or `StagedStep.from_buffer`.
      process_index: this process's index, recorded in the manifest.
      process_count: the job's process count, recorded in the manifest.

    Returns:
      The committed folder.

    Raises:
      CorruptStepError: a shard's bytes no longer match the checksum `staged` carries.
      FileExistsError: the step is already committed.
      OSError: from writing; nothing is committed then.
    """
    staged.to_host()  # shards staged as device-side copies arrive in host memory here
    root = self.directory
    final = root / str(staged.step)
    tmp = root / f"{TMP_PREFIX}{staged.step}-{uuid.uuid4().hex}"
    spare = self._take_spare()
    if spare is not None:
      os.rename(spare, tmp)
      os.chmod(tmp, self.dir_mode)
      for extra in tmp.iterdir():
        if extra.name != DATA or not stat.S_ISREG(extra.lstat().st_mode):
          if extra.is_dir() and not extra.is_symlink():
            shutil.rmtree(extra)
          else:
            extra.unlink()
    else:
      make_private_dir(tmp, self.dir_mode, exist_ok=False)
    ranges = [(s.offset, s.nbytes) for it in staged.items.values() for leaf in it.leaves
              for s in leaf.shards]
    data_path = tmp / DATA
    try:
      fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   self.file_mode)
      try:
        os.fchmod(fd, self.file_mode)  # the umask, or a reused spare's old mode
        values = None
        if staged.borrowed and spare is not None:
          # Views of CPU arrays' buffers, straight into a reused file's pages: one copy, not
          # two (into the pool, then into the file); they are let go of as it ends.
          values = data_write.write_in_place(fd, staged.size, staged.copy_into, ranges,
                                             self._crc_pool)
        if values is None:
          if staged.borrowed:  # copied out and let go of first
            staged.release(self._host_pool.get(staged.size))
          crcs = self._crc_pool.submit(_crc_staged, staged, ranges)
          data_write.write_parallel(fd, staged.views(), self._write_pool, self.write_threads)
          os.ftruncate(fd, staged.size)
          values = crcs.result()
        os.fsync(fd)
      finally:
        os.close(fd)
      crc_values = iter(values)

      def checked(item: str, leaf: LeafRecord, shard: ShardRecord) -> ShardRecord:
        value = next(crc_values)
        # A step written back after a recovery carries its checksums: they must still hold.
        if shard.crc32c and shard.crc32c != value:
          raise CorruptStepError(f"step {staged.step}: leaf {item}{leaf.path} changed while "
                                 "being written (checksum mismatch); not committed")
        return dataclasses.replace(shard, crc32c=value)

      items = {}
      for name, it in staged.items.items():
        leaves = tuple(dataclasses.replace(
            leaf, shards=tuple(checked(name, leaf, s) for s in leaf.shards))
            for leaf in it.leaves)
        items[name] = dataclasses.replace(it, leaves=leaves)
      manifest = StepManifest(step=staged.step, process_index=process_index,
                              process_count=process_count, items=items, data_size=staged.size,
                              created_at=time.time(), default_item=staged.default_item)
      write_atomic(tmp / MANIFEST, manifest.to_json(), mode=self.file_mode,
                   tmp_name=MANIFEST + ".tmp")
      with self._lock:
        if os.path.lexists(final):
          aside.clear_way(root, staged.step, replace, self.dir_mode, read_manifest)
        os.rename(tmp, final)  # the commit point
        fsync_dir(root)
        self.saved_counts.record(staged.step, process_count)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    try:
      self.apply_retention()
    finally:
      if self._on_commit is not None:
        steps = self.steps()
        if steps:
          self._on_commit(steps[-1])
    return final

  def _take_spare(self) -> Path | None:
    with self._lock:
      for entry in self.directory.iterdir():
        if entry.name.startswith(SPARE_PREFIX) and not entry.is_symlink():
          return entry
    return None

  def apply_retention(self) -> list[int]:
    """Retires committed steps beyond `max_to_keep`, never the newest; returns them."""
    steps = committed_steps(self.directory)
    spared = (self.keep_floor, self.keep_replicated, self.keep_sending)
    if self.keep is not None:
      kept = self.keep(steps, self.keep_floor)
      victims = [s for s in steps if s not in kept and s not in spared]
    else:
      victims = [] if self.max_to_keep is None else [
          s for s in steps[: max(0, len(steps) - self.max_to_keep)] if s not in spared]
    for step in victims:
      self.retire(step)
    aside.prune(self.directory, set(steps) - set(victims))
    return victims

  def retire(self, step: int) -> None:
    """Un-commits a step (atomic rename) and keeps its files for reuse by the next save."""
    src = self.directory / str(step)
    aside.remove_step(self.directory, step)
    with self._lock:
      enough_spares = not self.reuse_files or sum(
          e.name.startswith(SPARE_PREFIX) for e in self.directory.iterdir()) >= self.spares
      target = self.directory / (f"{TMP_PREFIX}del-{uuid.uuid4().hex}" if enough_spares
                                 else f"{SPARE_PREFIX}{uuid.uuid4().hex}")
      try:
        os.rename(src, target)
      except FileNotFoundError:
        return
    if enough_spares:
      shutil.rmtree(target, ignore_errors=True)

  def delete(self, step: int) -> None:
    """Removes a committed step (a step-named link: the link only); no error if absent."""
    src = self.directory / str(step)
    aside.remove_step(self.directory, step)
    if src.is_symlink():  # never a step of ours: drop the link, not what it points to
      src.unlink()
      return
    if not src.exists():
      return
    target = self.directory / f"{TMP_PREFIX}del-{uuid.uuid4().hex}"
    with self._lock:
      os.rename(src, target)
    shutil.rmtree(target, ignore_errors=True)

  def steps(self) -> list[int]:
    """The committed steps, oldest first."""
    return committed_steps(self.directory)

  def manifest(self, step: int) -> StepManifest:
    """The checked manifest of a committed step (see `read_manifest`)."""
    return read_manifest(self.directory / str(step), process_index=self.process_index,
                         process_count=self.process_count)

  def close(self) -> None:
    """Stops the checksum thread (after its work); call when no `write` runs any more."""
    self._crc_pool.shutdown(wait=True)
    if self._write_pool is not None:
      self._write_pool.shutdown(wait=True)
