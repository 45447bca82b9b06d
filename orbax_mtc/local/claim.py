"""Claiming this process's RAM folder at start-up, agreed across the job.

Two processes given one folder, a path that is a file, a folder owned by another user or not
writable: each is found before anything in the folder is touched, and a failure on any
process is raised on every process together (rule 9), instead of leaving the others waiting
in their next collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbax_mtc import agreement, files
from orbax_mtc.local import lock as local_lock
from orbax_mtc.summary import Summary


def claim_local_directory(local_path: Path, *, job_name: str, process_index: int,
                          prepare: Callable[[], None], summarize: Callable[[Any, str], Summary],
                          on_takeover: Callable[[], None] | None = None
                          ) -> local_lock.LocalDirectoryLock | None:
  """Claims `local_path` for this process (a lock naming the holder) and prepares it.

  Args:
    local_path: this process's RAM folder.
    job_name: the job's name (in the lock).
    process_index: this process.
    prepare: readies what the folder holds once it is claimed (the leftovers of the RAM tier,
      the peer copies and the LKG links), raising OSError or ValueError.
    summarize: summarizes one agreement record of every process (summary.py).
    on_takeover: runs when a manager made later in this process claims the same folder.

  Returns:
    The lock (released by the manager's `close`).

  Raises:
    LocalDirectoryInUseError, ValueError, OSError: on this process;
    agreement.CheckpointError: when another process failed.
  """
  lock: local_lock.LocalDirectoryLock | None = None
  error: Exception | None = None
  try:
    if local_path.exists() and not local_path.is_dir():
      raise ValueError(
          f"local_directory {local_path} exists and is not a directory. Point "
          "local_directory at a folder on the RAM disk (e.g. /dev/shm/ckpt) or remove the "
          "file.")
    existed = local_path.is_dir()
    if existed:  # before the lock file is made in it
      files.check_owner(local_path, "local_directory")
    try:
      lock = local_lock.LocalDirectoryLock.claim(local_path, job_name=job_name,
                                                 process_index=process_index,
                                                 on_takeover=on_takeover)
    except OSError as e:
      if not existed:
        raise ValueError(f"Cannot create local_directory {local_path}: {e.strerror}. Choose "
                         "a writable folder on the RAM disk (e.g. /dev/shm/ckpt).") from e
      raise ValueError(f"local_directory {local_path} is not writable by this process (uid "
                       f"{os.getuid()}): {e.strerror}. Fix its permissions or choose another "
                       "folder.") from e
    prepare()
  except (local_lock.LocalDirectoryInUseError, ValueError, OSError) as e:
    error = e
  found = summarize(agreement.StartRecord(fault=agreement.Fault.of(error)),
                    "opening the local directory")
  if not found.own_faults:
    return lock
  if lock is not None:
    lock.release()
  if error is not None:
    raise error
  raise agreement.CheckpointError(found.named("opening the local directory"),
                                  found.error_origins())
