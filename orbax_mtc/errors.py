"""The public errors of orbax-mtc, in one place (each raised by the part named in its text).

Nothing here imports another module of the package, so every part can raise them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
  """A checkpoint operation failed on one or more processes; raised on every process alike.

  Args:
    what: The operation that failed, named in the message.
    origins: Each failing process -> its error, as "<type>: <message>".

  Attributes:
    origins: A copy of `origins`.
  """

  def __init__(self, what: str, origins: dict[int, str]) -> None:
    listed = "; ".join(f"process {p}: {cause}" for p, cause in sorted(origins.items()))
    super().__init__(f"orbax-mtc: {what} failed on process(es) {sorted(origins)}: {listed}. "
                     "Every process raises this error; committed steps are untouched.")
    self.origins = dict(origins)


class AgreementTimeoutError(TimeoutError):
  """Some processes did not reach an agreement in time (they failed, hang or were killed)."""


class BackupError(RuntimeError):
  """The newest persistent backup failed; the RAM tier (and peers) still hold the step.

  Args:
    step: The step whose backup failed.
    cause: The error the backup raised.

  Attributes:
    step: The step whose backup failed.
    cause: The error the backup raised.
  """

  def __init__(self, step: int, cause: BaseException) -> None:
    super().__init__(
        f"orbax-mtc: persistent backup of step {step} failed: {type(cause).__name__}: {cause}. "
        "The step is still in the RAM tier; the next scheduled backup tries again. Check that "
        "the persistent directory is reachable and writable.")
    self.step = step
    self.cause = cause


class LocalTierError(RuntimeError):
  """A local step cannot be used (missing, partial, corrupt): restore falls back."""


class CorruptStepError(LocalTierError):
  """Bytes on the RAM disk do not match their checksum."""


class ManifestError(LocalTierError):
  """A manifest is unreadable, inconsistent, or does not belong where it was found."""


class AbstractStateMismatchError(ValueError):
  """The target tree does not match what was saved (names the leaf and both specs)."""


class MissingItemError(AbstractStateMismatchError):
  """The restore asks for an item the step was saved without.

  Attributes:
    item: The item's name.
  """

  def __init__(self, message: str, item: str) -> None:
    super().__init__(message)
    self.item = item


class LocalDirectoryInUseError(RuntimeError):
  """Another process holds the local directory.

  Args:
    directory: the local directory.
    holder: who the lock file names (`local.lock.LockHolder`), or None when it names no one.
  """

  def __init__(self, directory: Path, holder: Any) -> None:
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


class LocalDirectoryTakenOverError(RuntimeError):
  """A CheckpointManager made later in this process took this one's local directory over."""

  def __init__(self, directory: Path) -> None:
    self.directory = directory
    super().__init__(
        f"local directory {directory} was taken over by a CheckpointManager made later in this "
        "process: this manager no longer saves, restores or deletes (it still lists and "
        "reloads; its committed steps are the newer manager's now). Use the newer manager; "
        "close() on this one releases the rest.")


class ReplicatorError(RuntimeError):
  """The replicator reported a fatal error, or its files break the protocol."""
