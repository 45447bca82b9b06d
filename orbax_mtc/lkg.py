"""Last-known-good links: `<job>-s<step>-n<node_rank>-w<worker_index>.restore`.

The link lives in the node's local directory and points at the newest committed step folder.
Standalone mode keeps it up to date after each local commit; managed mode reads the entries a
GKE replicator writes (where a zero-size regular file with step 0 means "nothing to restore").
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from pathlib import Path

RESTORE_SUFFIX = ".restore"
_RESTORE_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<node>\d+)-w(?P<worker>\d+)\.restore$")


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


def update(directory: Path, job_name: str, step: int, node_rank: int, worker_index: int) -> Path:
  """Points this node's LKG link at `<directory>/<step>` and drops its older links.

  The new link is made under a temporary name and renamed into place, so a reader always sees
  either the old link or the new one.
  """
  name = link_name(job_name, step, node_rank, worker_index)
  final = directory / name
  tmp = directory / f".{name}.{uuid.uuid4().hex}.tmp"
  os.symlink(str(step), tmp)  # relative: the local directory may be mounted elsewhere later
  os.replace(tmp, final)
  for entry in list_entries(directory, strict=False):
    if (entry.name != name and entry.job_name == job_name and entry.node_rank == node_rank
        and entry.worker_index == worker_index):
      (directory / entry.name).unlink(missing_ok=True)
  return final


def remove_all(directory: Path, job_name: str, node_rank: int, worker_index: int) -> None:
  for entry in list_entries(directory, strict=False):
    if (entry.job_name == job_name and entry.node_rank == node_rank
        and entry.worker_index == worker_index):
      (directory / entry.name).unlink(missing_ok=True)
