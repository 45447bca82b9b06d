"""Each process claims its local directory, so two processes given one fail at once.

Two processes writing step folders, `.restore` links and peer copies into one local directory
(a launcher mistake) would corrupt each other or wait on each other forever. The claim is an
exclusive `flock` on `<local>/.lock`, which also holds a small JSON naming the holder (job,
process index, host, pid) for the error the second process raises.

The kernel drops a `flock` when its last file descriptor closes, so a process killed by
SIGKILL leaves no claim: a restart takes over the stale `.lock` file. Locks belong to the
open file description, so a second claim in the same process fails too. The file is never
removed: a process that opened it just before the removal would lock a file no one else sees.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"
_MAX_READ = 64 << 10
# The holder writes its JSON just after it takes the lock: a loser may read an empty file.
_READ_RETRY_S = 0.5


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


class LocalDirectoryInUseError(RuntimeError):
  """Another process (or another claim in this one) holds the local directory."""

  def __init__(self, directory: Path, holder: LockHolder | None):
    self.directory = directory
    self.holder = holder
    if holder is None:
      who = "another process (its .lock does not say which)"
    else:
      who = (f"process {holder.process_index} of job {holder.job_name!r} on host "
             f"{holder.host} (pid {holder.pid})")
      if holder.pid == os.getpid() and holder.host == socket.gethostname():
        who += (" - this very process: close the CheckpointManager that uses it before making "
                "another")
    super().__init__(
        f"local directory {directory} is already used by {who}: every process needs its own "
        "local directory (e.g. /dev/shm/ckpt/<process index>); orbax-mtc launch gives each "
        "process one.")


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
  """An exclusive claim on one local directory, held until `release` or process exit."""

  def __init__(self, directory: Path, fd: int, holder: LockHolder):
    self.directory = directory
    self.holder = holder
    self._fd: int | None = fd

  @classmethod
  def claim(cls, directory: Path, *, job_name: str, process_index: int) -> LocalDirectoryLock:
    """Claims `directory` (created with mode 0700 if missing); raises LocalDirectoryInUseError
    naming the holder when a live process, or another claim of this one, has it."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    # O_NOFOLLOW: a `.lock` symlink must not make us truncate a file elsewhere.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
          raise
        raise LocalDirectoryInUseError(directory, _wait_for_holder(directory)) from None
      holder = LockHolder(job_name=job_name, process_index=process_index,
                          host=socket.gethostname(), pid=os.getpid())
      if os.fstat(fd).st_mode & 0o777 != 0o600:
        try:
          os.fchmod(fd, 0o600)  # a stale file another tool made: the holder's pid is private
        except OSError:
          pass  # not ours to change; the claim holds all the same
      os.ftruncate(fd, 0)
      os.pwrite(fd, holder.to_json().encode(), 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)  # drops the flock if we took it
      raise
    return cls(directory, fd, holder)

  @property
  def held(self) -> bool:
    return self._fd is not None

  def release(self) -> None:
    """Gives the directory up; idempotent."""
    fd, self._fd = self._fd, None
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


def _wait_for_holder(directory: Path) -> LockHolder | None:
  deadline = time.monotonic() + _READ_RETRY_S
  while True:
    holder = read_holder(directory)
    if holder is not None or time.monotonic() >= deadline:
      return holder
    time.sleep(0.02)
