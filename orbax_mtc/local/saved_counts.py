"""Which process count saved each committed step folder of one local directory.

A node's own folder of a step saved by a job of another process count holds another share of
the state: the step agreements do not count it as this node's own step (only the elastic
check lists it, where the cluster covers it: restore/executor.elastic_steps), or
`latest_step()` could name a step `restore` cannot build. The count is read once per folder
from its manifest; a folder renamed into place (a commit, a write-back, a replicator's entry)
has a new inode or change time, so it is read again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orbax_mtc.local.format import LocalTierError


def _folder_key(folder: Path) -> tuple[int, int]:
  status = os.stat(folder, follow_symlinks=False)
  return status.st_ino, status.st_ctime_ns


class SavedCounts:
  """The saving process count of each step folder under `directory`, cached.

  Args:
    directory: the local directory.
    process_count: this job's process count (None: unknown, every step counts).
    read_manifest: reads a step folder's manifest (`store.read_manifest`).
  """

  def __init__(self, directory: Path, process_count: int | None,
               read_manifest: Callable[[Path], Any]):
    self._directory = Path(directory)
    self._process_count = process_count
    self._read_manifest = read_manifest
    # step -> (the folder's inode and change time, the count that saved it; None: unreadable)
    self._known: dict[int, tuple[tuple[int, int], int | None]] = {}

  def record(self, step: int, count: int) -> None:
    """A folder of `step` was just committed here by a job of `count` processes."""
    self._known[step] = (_folder_key(self._directory / str(step)), count)

  def of_this_count(self, steps: Sequence[int]) -> list[int]:
    """The `steps` saved by this job's process count (and those whose count is unknown: an
    unreadable folder is listed as before, and a restore finds the damage)."""
    if self._process_count is None:
      return list(steps)
    for gone in set(self._known) - set(steps):  # retired: the cache stays as small as RAM
      self._known.pop(gone, None)
    return [step for step in steps if self._count(step) in (None, self._process_count)]

  def _count(self, step: int) -> int | None:
    folder = self._directory / str(step)
    try:
      key = _folder_key(folder)
    except OSError:
      return None
    known = self._known.get(step)
    if known is not None and known[0] == key:
      return known[1]
    try:
      count = self._read_manifest(folder).process_count
    except (OSError, ValueError, LocalTierError):
      count = None
    self._known[step] = (key, count)
    return count
