"""Writing a step's bytes into its data file: gathered system calls, and on hosts with cores to
spare several threads at once. One thread's copies into the page cache fall short of what a
RAM disk takes, and tmpfs serialises `write` calls into one file on its inode lock, so the
threads copy into a shared mapping of the file instead, its space reserved first with
`posix_fallocate` (a full RAM disk is then ENOSPC before any byte is copied, not SIGBUS in
the middle of a copy).

File I/O only: the RAM tier's writer thread calls it (rule 2).
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from orbax_mtc.local import checksum

WRITE_CHUNK = 64 << 20  # bytes per system call at most
IOV_MAX = 1024  # Linux: views per pwritev call
# Below this a step is written by one thread (a thread's start costs more than it saves).
PARALLEL_MIN_BYTES = 64 << 20
RUN_ALIGN = 1 << 20  # the threads' ranges start at multiples of this


def default_threads(cpus: int | None = None) -> int:
  """Threads a host writes a step with: one per 4 cores, at most 4, at least 1 (a 2-core
  host, whose other core runs the training step and the checksums, writes with one)."""
  cpus = os.cpu_count() if cpus is None else cpus
  return max(1, min(4, (cpus or 1) // 4))


def write_views(fd: int, views: Sequence[memoryview], offset: int = 0) -> None:
  """Writes `views` back to back from `offset`: gathered into calls of up to WRITE_CHUNK
  bytes and IOV_MAX views (many small leaves cost few system calls), short writes resumed."""
  batch: list[memoryview] = []
  batch_bytes = 0

  def flush() -> None:
    nonlocal batch_bytes, offset
    done = os.pwritev(fd, batch, offset)
    at = offset + done
    for view in batch:  # resumes a short write (rare): the rest one view at a time
      if done >= view.nbytes:
        done -= view.nbytes
        continue
      rest, done = view[done:], 0
      while rest.nbytes:
        n = os.pwrite(fd, rest, at)
        rest, at = rest[n:], at + n
    offset += batch_bytes
    batch.clear()
    batch_bytes = 0

  for view in views:
    for start in range(0, view.nbytes, WRITE_CHUNK):
      part = view[start:start + WRITE_CHUNK]
      if batch and (batch_bytes + part.nbytes > WRITE_CHUNK or len(batch) >= IOV_MAX):
        flush()
      batch.append(part)
      batch_bytes += part.nbytes
  if batch:
    flush()


def split_views(views: Sequence[memoryview], parts: int,
                align: int = 1 << 20) -> list[tuple[int, list[memoryview]]]:
  """`views` (back to back from offset 0) cut into at most `parts` runs of about equal bytes,
  each but the last a multiple of `align`: (the run's offset, its views). Pure."""
  total = sum(view.nbytes for view in views)
  target = max(align, -(-total // max(1, parts) // align) * align)
  runs: list[tuple[int, list[memoryview]]] = []
  current: list[memoryview] = []
  start = filled = 0
  for view in views:
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    while view.nbytes:
      take = min(view.nbytes, target - filled)
      current.append(view[:take])
      view, filled = view[take:], filled + take
      if filled == target:
        runs.append((start, current))
        start, current, filled = start + filled, [], 0
  if current:
    runs.append((start, current))
  return runs


def _copy_runs(target: memoryview, runs: Sequence[tuple[int, list[memoryview]]],
               first: int, step: int) -> None:
  """Copies every `step`-th run from `first` into `target` (numpy copies release the GIL)."""
  for start, views in runs[first::step]:
    at = start
    for view in views:
      np.frombuffer(target[at:at + view.nbytes], np.uint8)[:] = np.frombuffer(view, np.uint8)
      at += view.nbytes


def write_parallel(fd: int, views: Sequence[memoryview],
                   pool: concurrent.futures.Executor | None, threads: int) -> None:
  """Writes `views` back to back from offset 0 with `threads` threads (the calling thread and
  `pool`'s), through a shared mapping of the file (`fd` open for reading and writing: a
  shared mapping needs both); one thread with `write_views` below
  PARALLEL_MIN_BYTES or where the file system cannot reserve the space. Every thread has
  finished (or failed) before this returns; the first error is raised."""
  total = sum(view.nbytes for view in views)
  if pool is None or threads <= 1 or total < PARALLEL_MIN_BYTES:
    write_views(fd, views)
    return
  try:
    os.posix_fallocate(fd, 0, total)
  except OSError as e:
    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
      raise  # ENOSPC: the RAM disk is full; nothing was copied
    write_views(fd, views)
    return
  runs = split_views(views, threads * 4, RUN_ALIGN)  # a few runs each: a slow one evens out
  # Populated: the kernel maps every page at once (one fault per page costs more than the
  # copy on this 2-core VM: 3.4 against 4.9 GB/s with two threads, 1 GiB).
  try:
    mapping = mmap.mmap(fd, total, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                        mmap.PROT_WRITE)
  except OSError:  # a file system that cannot map it: one thread, as below the threshold
    write_views(fd, views)
    return
  try:
    target = memoryview(mapping)
    try:
      futures = [pool.submit(_copy_runs, target, runs, i, threads) for i in range(1, threads)]
      error: BaseException | None = None
      try:
        _copy_runs(target, runs, 0, threads)
      except BaseException as e:  # noqa: BLE001 - raised once the other threads are over
        error = e
      for future in futures:  # never leave a thread copying into a mapping being closed
        try:
          future.result()
        except BaseException as e:  # noqa: BLE001 - the first error wins
          error = error or e
      if error is not None:
        raise error
    finally:
      target.release()
  finally:
    mapping.close()


class Copied:
  """How far a step's bytes are in its file: the writing thread moves it on, the checksum
  thread waits for the bytes it reads (`until`)."""

  def __init__(self) -> None:
    self._changed = threading.Condition()
    self._end = 0
    self._stopped = False

  def advance(self, end: int) -> None:
    with self._changed:
      self._end = max(self._end, end)
      self._changed.notify_all()

  def stop(self) -> None:
    """No more bytes come (the copy is over, or failed)."""
    with self._changed:
      self._stopped = True
      self._changed.notify_all()

  def until(self, end: int) -> None:
    """Returns once the bytes before `end` are in; raises if the copy stopped short."""
    with self._changed:
      self._changed.wait_for(lambda: self._stopped or self._end >= end)
      if self._end < end:
        raise RuntimeError(f"the copy stopped at byte {self._end}, before {end}")


def _crc_copied(target: np.ndarray, ranges: Sequence[tuple[int, int]], copied: Copied
                ) -> list[int]:
  """The CRC32C of each (offset, nbytes) range of `target`, each part once it is copied."""
  values = []
  for offset, nbytes in ranges:
    value = 0
    for lo in range(offset, offset + nbytes, checksum.CRC_CHUNK):
      hi = min(offset + nbytes, lo + checksum.CRC_CHUNK)
      copied.until(hi)
      value = checksum.crc_extend(value, target[lo:hi])
    values.append(value)
  return values


def write_in_place(fd: int, size: int,
                   copy_into: Callable[[np.ndarray, Callable[[int], None]], None],
                   ranges: Sequence[tuple[int, int]], crc_pool: concurrent.futures.Executor
                   ) -> list[int] | None:
  """Copies a step straight into a reused data file's pages (`copy_into(target, copied)`:
  `StagedStep.copy_into`), the checksums of `ranges` following the copy on `crc_pool`: one
  copy where the pool and then the file took two. Returns the checksums; None, with nothing
  written, where the file is smaller than `size` (its pages would be new: the arrays'
  buffers would be held the longer) or cannot be mapped.

  No space is reserved: the file is a step this tier wrote, every byte of it, so its pages
  exist and a full RAM disk cannot fault the copy (reserving them again took 0.03 s a GiB)."""
  if size <= 0 or os.fstat(fd).st_size < size:
    return None
  os.ftruncate(fd, size)
  try:
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                        mmap.PROT_READ | mmap.PROT_WRITE)
  except OSError:
    return None
  target = np.frombuffer(mapping, np.uint8)
  copied = Copied()
  try:
    crcs = crc_pool.submit(_crc_copied, target, ranges, copied)
    try:
      copy_into(target, copied.advance)
    finally:
      copied.stop()  # a failed copy wakes the checksums (the copy's error is raised)
      crcs.exception()  # the checksum thread is out of the mapping before it is closed
    return crcs.result()
  finally:
    del target
    try:
      mapping.close()
    except BufferError:  # a view still held (an error's traceback): unmapped once it goes
      pass
