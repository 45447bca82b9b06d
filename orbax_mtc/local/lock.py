"""Each process claims its local directory, so two processes given one fail at once.

Two processes writing step folders, `.restore` links and peer copies into one local directory
(a launcher mistake) would corrupt each other or wait on each other forever. The claim is an
exclusive `flock` on `<local>/.lock`, which also holds a small JSON naming the holder (job,
process index, host, pid) for the error the second process raises.

The kernel drops a `flock` when its last file descriptor closes, so a process killed by
SIGKILL leaves no claim: a restart takes over the stale `.lock` file. Locks belong to the
open file description, so a second claim in the same process would fail too: instead, as two
Orbax managers on one directory both work, a second claim in the same process takes the
directory over from the first (the first lock's `on_takeover` runs first: the manager that held
it finishes its file writes and stops using the folder). The file is never removed: a process
that opened it just before the removal would lock a file no one else sees.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from absl import logging

# Re-exported: these errors lived here before errors.py, and other modules name them
# through this one.
from orbax_mtc.errors import LocalDirectoryInUseError as LocalDirectoryInUseError
from orbax_mtc.errors import LocalDirectoryTakenOverError as LocalDirectoryTakenOverError

LOCK_FILE = ".lock"
_MAX_READ = 64 << 10
# The holder writes its JSON just after it takes the lock: a loser may read an empty file.
_READ_RETRY_S = 0.5
# The claims this process holds, by the directory's (device, inode): a second claim of one of
# them in this process takes it over instead of failing on its own flock.
_held_here: dict[tuple[int, int], LocalDirectoryLock] = {}
_held_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class LockHolder:
  """Who claims a local directory."""

  job_name: str
  process_index: int
  host: str
  pid: int

  def to_json(self) -> str:
    return json.dumps({"job": self.job_name, "process_index": self.process_index,
                       "host": self.host, "pid": self.pid})

  @classmethod
  def from_json(cls, text: str | bytes) -> LockHolder:
    """Raises ValueError when `text` is not what `to_json` writes."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
      raise ValueError("not a JSON object")
    job, index, host, pid = (raw.get(k) for k in ("job", "process_index", "host", "pid"))
    if not (isinstance(job, str) and isinstance(host, str) and _is_int(index) and _is_int(pid)):
      raise ValueError(f"unexpected fields {raw!r}")
    return cls(job_name=job, process_index=index, host=host, pid=pid)


def _is_int(value: object) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def read_holder(directory: Path) -> LockHolder | None:
  """What `<directory>/.lock` says; None if it is absent, empty or unreadable."""
  try:
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    return LockHolder.from_json(os.read(fd, _MAX_READ))
  except (OSError, ValueError, RecursionError):  # ValueError: bad JSON, UTF-8 or fields
    return None
  finally:
    os.close(fd)


class LocalDirectoryLock:
  """An exclusive claim on one local directory, held until `release`, process exit, or a later
  claim of the same directory in this process (`taken_over` is then True)."""

  def __init__(self, directory: Path, fd: int, holder: LockHolder, key: tuple[int, int],
               on_takeover: Callable[[], None] | None):
    self.directory = directory
    self.holder = holder
    self.taken_over = False
    self._fd: int | None = fd
    self._key = key
    self._on_takeover = on_takeover

  @classmethod
  def claim(cls, directory: Path, *, job_name: str, process_index: int,
            on_takeover: Callable[[], None] | None = None) -> LocalDirectoryLock:
    """Claims `directory` (created with mode 0700 if missing).

    Args:
      directory: the local directory.
      job_name: the job's name (in the lock file).
      process_index: this process (in the lock file).
      on_takeover: runs when a later claim in this process takes the directory over, before
        that claim returns (the holder stops writing into the folder).

    Raises:
      LocalDirectoryInUseError: naming the holder, when another live process has it.
    """
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    holder = LockHolder(job_name=job_name, process_index=process_index,
                        host=socket.gethostname(), pid=os.getpid())
    with _held_lock:
      info = directory.stat()
      key = (info.st_dev, info.st_ino)
      previous = _held_here.get(key)
      if previous is not None and previous.held and previous.holder.pid == os.getpid():
        fd = previous._hand_over()
      else:
        fd = _flock(directory)
      try:
        _write_holder(fd, holder)
      except BaseException:
        os.close(fd)  # drops the flock: no descriptor may hold it unowned
        raise
      lock = cls(directory, fd, holder, key, on_takeover)
      _held_here[key] = lock
    return lock

  def _hand_over(self) -> int:
    """Ends this claim in favour of a later one in this process; returns its descriptor."""
    if self._on_takeover is not None:
      try:
        self._on_takeover()
      except Exception as e:  # noqa: BLE001 - the holder's trouble must not refuse the newer
        logging.warning("orbax-mtc: finishing the work of the manager whose local directory "
                        "%s is taken over failed: %s: %s", self.directory, type(e).__name__, e)
    fd, self._fd = self._fd, None
    assert fd is not None
    self.taken_over = True
    return fd

  @property
  def held(self) -> bool:
    return self._fd is not None

  def release(self) -> None:
    """Gives the directory up; idempotent (and a no-op once taken over)."""
    with _held_lock:
      fd, self._fd = self._fd, None
      if _held_here.get(self._key) is self:
        del _held_here[self._key]
    if fd is None:
      return
    try:
      os.ftruncate(fd, 0)  # a released claim names no holder
    except OSError:
      pass  # the claim ends with the close all the same
    finally:
      os.close(fd)

  def __enter__(self) -> LocalDirectoryLock:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.release()

  def __repr__(self) -> str:
    return (f"LocalDirectoryLock({str(self.directory)!r}, holder={self.holder!r}, "
            f"held={self.held})")


def _flock(directory: Path) -> int:
  """The lock file's descriptor, flock-ed; LocalDirectoryInUseError when another holds it."""
  # O_NOFOLLOW: a `.lock` symlink must not make us truncate a file elsewhere.
  fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      raise
    raise LocalDirectoryInUseError(directory, _wait_for_holder(directory)) from None
  return fd


def _write_holder(fd: int, holder: LockHolder) -> None:
  if os.fstat(fd).st_mode & 0o777 != 0o600:
    try:
      os.fchmod(fd, 0o600)  # a stale file another tool made: the holder's pid is private
    except OSError:
      pass  # not ours to change; the claim holds all the same
  os.ftruncate(fd, 0)
  os.pwrite(fd, holder.to_json().encode(), 0)
  os.fsync(fd)


def _wait_for_holder(directory: Path) -> LockHolder | None:
  deadline = time.monotonic() + _READ_RETRY_S
  while True:
    holder = read_holder(directory)
    if holder is not None or time.monotonic() >= deadline:
      return holder
    time.sleep(0.02)
