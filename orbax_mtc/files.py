"""Small-file helpers shared by the tiers: private folders and files, atomic replacement.

The RAM tier holds model weights, so its folders are created 0700 and files 0600 (by
default) and a file is never written through a symbolic link. A small file that readers poll
for (an LKG link's target record, `replicator.yaml`, `ondemand.json`) appears whole or not at
all: it is written under a temporary name, fsynced, and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
  """Flushes a folder's entries (a rename inside it) to stable storage."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def remove_uncommitted_first(path: Path, doomed_prefix: str) -> None:
  """Deletes `path`, renaming it first to a `doomed_prefix`-named sibling (an atomic
  un-commit): a process killed while deleting leaves only that name, never a half-deleted
  folder under its own. A link is removed itself, never what it points to; no error if
  `path` is gone."""
  if not os.path.lexists(path):
    return
  doomed = path.with_name(f"{doomed_prefix}{uuid.uuid4().hex}")
  try:
    os.rename(path, doomed)
  except FileNotFoundError:
    return
  if doomed.is_symlink():
    doomed.unlink()
  else:
    shutil.rmtree(doomed, ignore_errors=True)


def make_private_dir(path: Path, mode: int, *, exist_ok: bool = True) -> bool:
  """Creates a folder with exactly `mode` (the umask could only narrow it).

  Args:
    path: the folder to create; its parent must exist.
    mode: its permission bits.
    exist_ok: when False, an existing folder raises FileExistsError.

  Returns:
    True if this call created the folder.
  """
  try:
    os.mkdir(path, mode)
  except FileExistsError:
    if not exist_ok:
      raise
    return False
  os.chmod(path, mode)
  return True


def write_private_file(path: Path, data: bytes, mode: int) -> None:
  """Writes a new file (replacing a regular file, never through a link) with `mode`, fsynced."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
  try:
    os.fchmod(fd, mode)
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600,
                 sync_dir: bool = True, tmp_name: str | None = None) -> None:
  """Replaces `path` with `data` in one rename: a reader sees the old file or the new, whole.

  Args:
    path: the file to write; its folder must exist.
    data: the contents (str is written as UTF-8).
    mode: permission bits of the new file.
    sync_dir: also flush the folder, so the rename itself survives a crash.
    tmp_name: the temporary file's name in the same folder, where a protocol fixes it
      (default: a unique hidden name).

  Raises:
    OSError: the write or the rename failed; `path` is then unchanged and no temporary file
      is left behind.
  """
  path = Path(path)
  if isinstance(data, str):
    data = data.encode()
  tmp = path.with_name(tmp_name or f".{path.name}.{uuid.uuid4().hex}.tmp")
  try:
    write_private_file(tmp, data, mode)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  if sync_dir:
    fsync_dir(path.parent)


def check_owner(path: Path, what: str) -> None:
  """Raises ValueError unless this process's user owns `path` (it holds private weights)."""
  owner, me = os.stat(path).st_uid, os.geteuid()
  if owner != me:
    raise ValueError(
        f"{what} {path} is owned by uid {owner}, not by this process (uid {me}). The RAM tier "
        "holds the model's weights, so it only uses a folder of its own: choose another folder, "
        f"or give it to this user (chown {me} {path}; chmod 700 {path}).")
