"""The worker's event lines: written by `emit`, read back by the tests.

Every event is one machine-readable line on stdout, found by its mark even after a partial
log line; the launcher prefixes each line with `[node i] `::

  @@mtc SAVING step=6                  just before mgr.save(6)
  @@mtc SAVED step=6 saved=1
  @@mtc COMMITTED process=0 local=4,6 persistent=0,4
  @@mtc RESULT process=0 step=6 tier=local ok=1 leaves=6 detail=-
  @@mtc DONE
  @@mtc PREEMPTED process=0 step=7     (preempt) reached_preemption(7) was True
  @@mtc ONDEMAND-SAVED process=0 step=7 info_step=7 persistent=1 total=0.329

Fields are `key=value` tokens; `detail=` comes last and takes the rest of the line. This
module imports neither JAX nor the worker's other modules, so pytest imports it cheaply.
"""

from __future__ import annotations

import os
import re
import threading
import time

MARK = "@@mtc"

_LINE = re.compile(r"^(?:\[node (\d+)\] )?.*?" + re.escape(MARK) + r" ([\w-]+) ?(.*)$")


def emit(line: str) -> None:
  """One event line, written with one write(2): stdout and stderr share the launcher's pipe,
  and print() would write the text and its newline separately, letting a log line from a C++
  thread land between them. Lines carry MARK so that a parser finds them even after a partial
  log line."""
  data = f"{MARK} {line}\n".encode()
  while data:
    data = data[os.write(1, data):]


class LineCollector:
  """A text stream for `Job(output=...)` that keeps every line and lets a test wait for one."""

  def __init__(self):
    self._cond = threading.Condition()
    self._partial = ""
    self.lines: list[str] = []

  def write(self, text: str) -> int:
    with self._cond:
      text = self._partial + text
      *complete, self._partial = text.split("\n")
      self.lines.extend(complete)
      if complete:
        self._cond.notify_all()
    return len(text)

  def flush(self) -> None:
    pass

  def text(self) -> str:
    with self._cond:
      return "\n".join(self.lines + ([self._partial] if self._partial else []))

  def wait_for(self, predicate, timeout_s: float) -> bool:
    """Waits until predicate(lines) is true; False on timeout."""
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while not predicate(self.lines):
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
      return True


def events(lines: list[str], kind: str) -> list[tuple[int, dict[str, str]]]:
  """(node, {key: value}) of every `[node i] @@mtc KIND k=v ...` line (detail= takes the rest).

  Lines without the launcher's `[node i] ` prefix (a process run alone) count as node 0.
  """
  out = []
  for line in lines:
    m = _LINE.match(line)
    if not m or m.group(2) != kind:
      continue
    rest, fields = m.group(3), {}
    if " detail=" in rest or rest.startswith("detail="):
      rest, _, fields["detail"] = rest.partition("detail=")
    for token in rest.split():
      key, _, value = token.partition("=")
      fields[key] = value
    out.append((int(m.group(1) or 0), fields))
  return out


def parse_results(lines: list[str]) -> dict[int, dict[str, str]]:
  """node -> fields of its last RESULT line."""
  return {node: fields for node, fields in events(lines, "RESULT")}
