"""Replicator simulators as a test drives them: one `tests/replicator_sim.py` process per node,
its `@@sim` lines collected as they come."""

from __future__ import annotations

import contextlib
import pathlib
import re
import subprocess
import sys
import threading
from collections.abc import Callable

from mp_helpers import REPO_ROOT

SIM = REPO_ROOT / "tests" / "replicator_sim.py"
_SIM_LINE = re.compile(r"^@@sim (\w+) ?(.*)$")


class SimNode:
  """One simulator process; its @@sim lines are collected as they come."""

  def __init__(self, root: pathlib.Path, rank: int, backup: pathlib.Path, *extra: str):
    self.volume = root / f"node{rank}"
    self.lines: list[str] = []
    self._changed = threading.Condition()
    self.proc = subprocess.Popen(
        [sys.executable, str(SIM), "--volume", str(self.volume), "--volume-pattern",
         str(root / "node{rank}"), "--backup", str(backup), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    assert self.wait_for("READY"), self.text()

  def _read(self) -> None:
    for line in self.proc.stdout:
      with self._changed:
        self.lines.append(line.rstrip("\n"))
        self._changed.notify_all()

  def events(self, kind: str) -> list[dict[str, str]]:
    out = []
    for line in list(self.lines):
      m = _SIM_LINE.match(line)
      if m and m.group(1) == kind:
        out.append(dict(f.split("=", 1) for f in m.group(2).split()))
    return out

  def wait_for(self, kind: str, count: int = 1, timeout_s: float = 60) -> bool:
    return self.wait_until(lambda: len(self.events(kind)) >= count, timeout_s)

  def wait_until(self, condition: Callable[[], bool], timeout_s: float = 60) -> bool:
    """True once `condition` holds (checked at each line), False if the simulator exited or
    `timeout_s` passed first."""
    with self._changed:
      return self._changed.wait_for(lambda: condition() or self.proc.poll() is not None,
                                    timeout_s) and condition()

  def text(self) -> str:
    return "\n".join(self.lines[-40:])

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait(10)


@contextlib.contextmanager
def simulators(root: pathlib.Path, backup: pathlib.Path, nodes: int, extra=None):
  """One simulator per node; all are SIGKILLed on leaving the block."""
  sims: list[SimNode] = []
  try:
    for rank in range(nodes):
      sims.append(SimNode(root, rank, backup, *(extra or {}).get(rank, ())))
    yield sims
  finally:
    for sim in sims:
      sim.kill()


