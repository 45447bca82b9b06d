"""Last-known-good links: `<job>-s<step>-n<node_rank>-w<worker_index>.restore`.

The link lives in the node's local directory and points at the newest committed step folder's
manifest (`<step>/manifest.json`, written last): a link to a file, so a tool that walks the
folder and treats every directory in it as a step (`shutil.rmtree` of each, Orbax's
`test_utils.empty_directory`, `du`, `cp -r`) never meets the step a second time through it.
Standalone mode keeps it up to date after each local commit; managed mode reads the entries a
GKE replicator writes (where a zero-size regular file with step 0 means "nothing to restore").

A link is made as `.<link name>.<id>.tmp` and renamed into place; a process killed between the
two leaves that temporary link behind, so `update`, `remove_all` and `cleanup_temporary` (for
start-up) remove this node's and worker's leftovers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import uuid
from pathlib import Path

from orbax_mtc.local.format import MANIFEST

RESTORE_SUFFIX = ".restore"
_RESTORE_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<node>\d+)-w(?P<worker>\d+)\.restore$")
_TMP_RE = re.compile(r"^\.(?P<link>.+-s\d+-n\d+-w\d+\.restore)\.[^./]+\.tmp$")
# One process owns its local directory (local/lock.py), but its writer thread and main thread both
# keep the link: the sweep of leftovers must not take a temporary link another thread is making.
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class LkgEntry:
  job_name: str
  step: int
  node_rank: int
  worker_index: int
  name: str

  @property
  def nothing_to_restore(self) -> bool:
    return self.step == 0


def link_name(job_name: str, step: int, node_rank: int, worker_index: int) -> str:
  return f"{job_name}-s{step}-n{node_rank}-w{worker_index}{RESTORE_SUFFIX}"


def link_target(step: int) -> str:
  """What this node's link for `step` holds: relative, as the folder may be mounted elsewhere."""
  return f"{step}/{MANIFEST}"


def parse_link_name(name: str) -> LkgEntry:
  """Parses a `.restore` entry name; raises ValueError naming the expected form."""
  match = _RESTORE_RE.match(name)
  if match is None:
    raise ValueError(
        f"Malformed last-known-good entry {name!r}: expected "
        "'<job>-s<step>-n<node_rank>-w<worker_index>.restore', e.g. 'orbax-s100-n0-w0.restore'. "
        "Remove or rename the entry.")
  return LkgEntry(job_name=match["job"], step=int(match["step"]), node_rank=int(match["node"]),
                  worker_index=int(match["worker"]), name=name)


def list_entries(directory: Path, *, strict: bool = True) -> list[LkgEntry]:
  """All `.restore` entries of a local directory.

  Malformed names raise ValueError when `strict`; otherwise they are skipped (upkeep of our
  own links must not fail because someone else left a stray file).
  """
  if not directory.is_dir():
    return []
  entries = []
  for p in directory.iterdir():
    if not p.name.endswith(RESTORE_SUFFIX):
      continue
    try:
      entries.append(parse_link_name(p.name))
    except ValueError:
      if strict:
        raise
  return sorted(entries, key=lambda e: e.step)


def _is_ours(entry: LkgEntry, job_name: str, node_rank: int, worker_index: int) -> bool:
  return (entry.job_name, entry.node_rank, entry.worker_index) == (job_name, node_rank,
                                                                   worker_index)


def _remove_temporary(directory: Path, job_name: str, node_rank: int,
                      worker_index: int) -> list[Path]:
  removed = []
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return removed
  for name in names:
    match = _TMP_RE.match(name)
    if match is None:
      continue
    try:
      entry = parse_link_name(match["link"])
    except ValueError:
      continue
    path = directory / name
    # Only symlinks: that is all `update` makes; anything else under such a name is not ours.
    if _is_ours(entry, job_name, node_rank, worker_index) and path.is_symlink():
      path.unlink(missing_ok=True)
      removed.append(path)
  return removed


def cleanup_temporary(directory: Path, job_name: str, node_rank: int,
                      worker_index: int) -> list[Path]:
  """Removes this node's and worker's temporary links left by a process killed inside `update`
  (`.<job>-s<step>-n<node_rank>-w<worker_index>.restore.<id>.tmp`); returns those removed."""
  with _lock:
    return _remove_temporary(Path(directory), job_name, node_rank, worker_index)


def update(directory: Path, job_name: str, step: int, node_rank: int, worker_index: int) -> Path:
  """Points this node's LKG link at `<directory>/<step>` (its manifest) and drops its older
  links (and temporary links a killed process left).

  The new link is made under a temporary name and renamed into place, so a reader always sees
  either the old link or the new one.
  """
  directory = Path(directory)
  name = link_name(job_name, step, node_rank, worker_index)
  final = directory / name
  with _lock:
    _remove_temporary(directory, job_name, node_rank, worker_index)
    tmp = directory / f".{name}.{uuid.uuid4().hex}.tmp"
    os.symlink(link_target(step), tmp)
    try:
      os.replace(tmp, final)
    except BaseException:
      tmp.unlink(missing_ok=True)
      raise
    for entry in list_entries(directory, strict=False):
      if entry.name != name and _is_ours(entry, job_name, node_rank, worker_index):
        (directory / entry.name).unlink(missing_ok=True)
  return final


def remove_all(directory: Path, job_name: str, node_rank: int, worker_index: int) -> None:
  """Removes this node's and worker's links, and their leftover temporary links."""
  directory = Path(directory)
  with _lock:
    _remove_temporary(directory, job_name, node_rank, worker_index)
    for entry in list_entries(directory, strict=False):
      if _is_ours(entry, job_name, node_rank, worker_index):
        (directory / entry.name).unlink(missing_ok=True)


class LinkKeeper:
  """Keeps this node's LKG link on its newest committed step (standalone mode).

  In managed mode GKE's replicator writes the entries: every call is then a no-op.

  Args:
    directory: this node's RAM folder.
    job_name: the job's name.
    node_rank: this process.
    worker_index: this process's index inside its host.
    managed: the replicator owns the entries.
  """

  def __init__(self, directory: Path, job_name: str, node_rank: int, worker_index: int, *,
               managed: bool):
    self._directory = Path(directory)
    self._job_name = job_name
    self._node_rank = node_rank
    self._worker_index = worker_index
    self._managed = managed

  def committed(self, step: int) -> None:
    """Points the link at `step`, just committed (runs on the writer thread: file I/O)."""
    if not self._managed:
      update(self._directory, self._job_name, step, self._node_rank, self._worker_index)

  def refresh(self, steps: list[int]) -> None:
    """Re-points the link after steps were removed: at the newest of `steps`, or none."""
    if self._managed:
      return
    if steps:
      self.committed(max(steps))
    else:
      remove_all(self._directory, self._job_name, self._node_rank, self._worker_index)
