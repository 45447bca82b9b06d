"""The last stage of a RAM restore: the step re-protected where it is not in place.

A process whose step came from elsewhere (a twin, a peer's copy, another process's folder),
or every process when the layout changed (another mesh, process count or rank order), writes
the restored step into its own folder, and the peer copies involving it are sent again. Rule
10: nothing goes first. The folder it replaces is set aside at the new one's commit
(`local.aside`: a replaced layout keeps serving while the step is kept, a damaged folder is
never read again); old copies are replaced by new ones or dropped once the new layout's first
copies are out (`PeerCopies`); a re-sent copy never replaces a richer one (`peers.copy_store`). A
restore that read only some items writes nothing back: that would drop the others; nor does one
that cast a leaf to another dtype (the folder would no longer hold what was saved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from absl import logging

from orbax_mtc.local import aside
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.restore.tiles import BuiltStep


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a RAM restore did, as the write-back needs it (agreed but `built`).

  Attributes:
    step: The step.
    built: This process's restored items and their saved bytes.
    rewritten: The layout changed: every process writes the step in the new one.
    recovered: The processes whose step did not come from their own current folder.
  """

  step: int
  built: BuiltStep
  rewritten: bool
  recovered: tuple[int, ...]


class WriteBack:
  """Writes a restored step back where it is not in place.

  Args:
    me: this process.
    writer: the RAM tier's writer thread.
    peers: the peer copies (sent again).
    on_error: keeps an error of this process for the next agreement (rule 9: raised there on
      every process, not here on one while the others go on).
  """

  def __init__(self, *, me: int, writer: RamWriter, peers: PeerCopies,
               on_error: Callable[[BaseException], bool]):
    self._me, self._writer, self._peers = me, writer, peers
    self._on_error = on_error

  def run(self, done: Restored) -> None:
    """Collective (the peer copies' schedule): every process calls it with agreed `done`."""
    if not done.recovered:
      return  # every process restored from its own current folder: nothing to re-protect
    built = done.built
    if not built.complete or built.cast:
      # Either would write back less than was saved: some items, or bytes of another dtype.
      logging.info("orbax-mtc: step %d restored %s; its folders are kept as they were saved",
                   done.step, "with a dtype cast" if built.complete else "without all its items")
      return
    trees = {name: value for name, value in built.restored.items()
             if name not in built.json_names and name not in built.process_raw}
    if self._me in done.recovered:
      json_items = {name: built.restored[name] for name in built.json_names}
      try:
        staged = local_staging.stage(done.step, trees, json_items,
                                     default_item=built.default_item,
                                     process_items=built.process_raw)
      except Exception as e:  # noqa: BLE001 - nothing written: raised by the next agreement
        if not self._on_error(e):
          logging.error("orbax-mtc: write-back of step %d not staged: %s", done.step, e)
      else:
        self._writer.drain()  # copies received earlier land before the folder changes
        self._writer.write(staged, background=True,
                           replace=aside.REPLACED if done.rewritten else aside.DAMAGED)
    if self._peers.topology is None:
      return
    if done.rewritten:
      self._peers.schedule(done.step, trees)
    else:
      self._peers.schedule_recovery(done.step, self._peers.shard_sets(trees), done.recovered)
