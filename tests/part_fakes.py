"""Fakes shared by the tests of single parts (test_part_*.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from orbax_mtc.local.store import LocalTier


class LoggedTier(LocalTier):
  """The real RAM tier, its writes and deletes logged; `fail` makes the next write fail."""

  def __init__(self, directory: Path, log: list, **kwargs):
    super().__init__(directory, **kwargs)
    self.log, self.fail = log, False

  def write(self, staged, process_index, process_count, **kwargs):
    self.log.append(("local.write", staged.step))
    if kwargs.get("replace") is not None:
      self.log.append(("local.replace", staged.step, kwargs["replace"]))
    if self.fail:
      self.fail = False
      raise OSError(errno.ENOSPC, "No space left on device")
    return super().write(staged, process_index, process_count, **kwargs)

  def delete(self, step):
    self.log.append(("local.delete", step))
    super().delete(step)
