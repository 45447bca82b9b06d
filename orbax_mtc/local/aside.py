"""Step folders moved aside instead of deleted: a replaced layout and a damaged folder.

Rule 10 (docs/design.md): nothing is deleted until what replaces it is committed. When a step
is written again into a folder that already holds it (a write-back after an elastic restore,
a node whose own copy was unusable), the old folder is renamed aside at the commit instant,
never removed before it:

  <local>/.replaced-<step>-<id>/<step>/   a committed step of an older layout (another mesh,
                                          process count or rank); an elastic restore may
                                          still read it (it is named like a step folder, so
                                          its manifest checks as one)
  <local>/.damaged-<step>-<id>/           a folder that is no valid step (no manifest, a bad
                                          manifest, a short data file); never read again

Both stay while their step is kept and go with it (retention, delete), renamed to an
interrupted-save name first. A process killed between the two renames of a replacement
leaves a `.replaced-` folder and no `<step>`: the next start puts the old folder back
(`recover`). This module does file I/O only.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from absl import logging

from orbax_mtc.files import fsync_dir, make_private_dir, remove_uncommitted_first
from orbax_mtc.local.format import TMP_PREFIX, LocalTierError

REPLACED, DAMAGED = ".replaced-", ".damaged-"
_NAME = re.compile(r"^\.(replaced|damaged)-(\d+)-[0-9a-f]+$")


def parse(name: str) -> tuple[str, int] | None:
  """(prefix, step) of an aside folder's name, else None."""
  match = _NAME.match(name)
  if match is None:
    return None
  return f".{match.group(1)}-", int(match.group(2))


def move_aside(root: Path, step: int, prefix: str, dir_mode: int) -> Path:
  """Renames `<root>/<step>` aside (atomic); returns the new path of the step folder.

  A replaced step keeps its own name inside a wrapper folder, so that it still reads as a
  step folder; a damaged one is renamed as a whole.
  """
  wrapper = root / f"{prefix}{step}-{uuid.uuid4().hex}"
  if prefix == REPLACED:
    make_private_dir(wrapper, dir_mode, exist_ok=False)
    target = wrapper / str(step)
  else:
    target = wrapper
  os.rename(root / str(step), target)
  fsync_dir(root)
  return target


def clear_way(root: Path, step: int, replace: str | None, dir_mode: int,
              check: Callable[[Path], object]) -> None:
  """Moves `<root>/<step>` out of the way of a commit of `step`, which follows at once.

  A folder `check` refuses (LocalTierError: no manifest, a bad one, a short data file) is
  no valid step: it is moved aside as damaged, never left to block the commit. A valid one
  is set aside as `replace` says, or kept (FileExistsError) when `replace` is None.
  """
  final = root / str(step)
  if final.is_symlink():
    raise FileExistsError(f"local step {final} is a symbolic link; remove it")
  try:
    check(final)
  except LocalTierError as e:
    moved = move_aside(root, step, DAMAGED, dir_mode)
    logging.warning("orbax-mtc: %s was no valid step (%s); moved aside to %s (removed with "
                    "the step)", final, e, moved)
    return
  if replace is None:
    raise FileExistsError(f"local step {final} is already committed")
  moved = move_aside(root, step, replace, dir_mode)
  logging.info("orbax-mtc: the earlier folder of step %d is kept as %s until the step is "
               "retired", step, moved)


def replaced_folders(root: Path) -> list[tuple[int, Path]]:
  """(step, step folder) of every replaced layout kept under `root`, oldest step first."""
  out = []
  for entry in _entries(root):
    parsed = parse(entry.name)
    if parsed is None or parsed[0] != REPLACED:
      continue
    folder = entry / str(parsed[1])
    if folder.is_dir() and not folder.is_symlink():
      out.append((parsed[1], folder))
  return sorted(out)


def recover(root: Path) -> None:
  """At start-up: a replacement cut between its renames gets its old folder back; an empty
  wrapper (cut before the first rename) goes."""
  for entry in _entries(root):
    parsed = parse(entry.name)
    if parsed is None or parsed[0] != REPLACED:
      continue
    step = parsed[1]
    inner = entry / str(step)
    final = root / str(step)
    if inner.is_dir() and not inner.is_symlink() and not os.path.lexists(final):
      logging.warning("orbax-mtc: %s was set aside by a replacement that did not finish; "
                      "putting it back as %s", inner, final)
      os.rename(inner, final)
      fsync_dir(root)
    if not os.path.lexists(inner):
      shutil.rmtree(entry, ignore_errors=True)


def prune(root: Path, kept_steps: set[int]) -> None:
  """Removes the aside folders of steps no longer kept."""
  for entry in _entries(root):
    parsed = parse(entry.name)
    if parsed is not None and parsed[1] not in kept_steps:
      _discard(entry)


def remove_step(root: Path, step: int) -> None:
  """Removes the aside folders of one step (the step itself is being deleted)."""
  for entry in _entries(root):
    parsed = parse(entry.name)
    if parsed is not None and parsed[1] == step:
      _discard(entry)


def _discard(entry: Path) -> None:
  """Renames an aside folder to an interrupted-save name, then deletes it (rule 10): a
  process killed while deleting leaves what start-up removes, never a half-deleted
  `.replaced-` folder still listed as a layout, which `recover` could even put back as a
  step."""
  remove_uncommitted_first(entry, f"{TMP_PREFIX}del-")


def _entries(root: Path) -> list[Path]:
  try:
    return [e for e in root.iterdir() if not e.is_symlink() and e.is_dir()]
  except FileNotFoundError:
    return []
