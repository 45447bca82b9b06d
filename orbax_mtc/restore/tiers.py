"""Which tier a restore comes from: the cluster's RAM, else persistent, else nothing.

`restore(None)` takes the newest step the whole cluster can assemble from RAM (own folders,
twins, peers' copies, on any layout: executor.py), else the newest persistent step every process sees
(persistent.py), else starts from scratch. In managed mode the first `restore(None)`
honours the step the replicator's `.restore` entries name. After `restore(None)`, or the
restore of the newest step listed, RAM steps newer than the restored one belong to a timeline
the job abandons and are dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import format as local_format
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.managed import handshake
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.restore import outcome as agreed_outcome
from orbax_mtc.restore import persistent as persistent_restore
from orbax_mtc.restore.executor import RamRestore, RamRestoreResult
from orbax_mtc.summary import Summary


@dataclasses.dataclass
class RestoreInfo:
  """Where the last `restore` came from (for logs, the demo and `status`)."""

  step: int | None
  # "local" (own folder), "peer" (a twin or a peer's copy), "elastic" (rebuilt on another
  # mesh or process count, docs/elastic.md), "replicator" (managed mode's entry),
  # "persistent" or "none"
  tier: str
  seconds: float


class TieredRestore:
  """Restores from the best tier, the same way on every process.

  Args:
    ram: the RAM restore executor.
    persistent: the persistent tier.
    local: this node's RAM tier.
    store: the peer copies this node holds.
    writer: the RAM tier's writer thread.
    ledger: the agreed step lists and faults.
    delete_local: removes RAM steps (and re-points the LKG link).
    summarize: summarizes one agreement record of every process (summary.py).
  """

  def __init__(self, *, ram: RamRestore, persistent: PersistentTier,
               local: local_store.LocalTier, store: peer_store.PeerStore, writer: RamWriter,
               ledger: StepLedger, delete_local: Callable[[list[int]], None],
               summarize: Callable[[Any, str], Summary]):
    self._ram = ram
    self._persistent = persistent
    self._local = local
    self._store = store
    self._writer = writer
    self._ledger = ledger
    self._delete_local = delete_local
    self._summarize = summarize
    self.replicator_entry: int | None = None  # managed: the entry, until a restore or save
    self._listed: set[int] = set()  # the agreed steps as the current restore began
    self.last: RestoreInfo | None = None

  def restore(self, step: int | None, targets: dict[str, Any], single: bool | None) -> Any:
    """Restores `step` (None: the newest) from RAM, else from the persistent tier.

    Collective: every process calls it with the same step and targets.

    Returns:
      The restored item, or an `ocp.args.Composite` of items; None when `step` is None and
      nothing was saved.

    Raises:
      FileNotFoundError: `step` is in neither tier.
      local_format.AbstractStateMismatchError: the targets do not match what was saved.
      local_format.LocalTierError: `step` is in RAM everywhere but unusable, and not
        persistent.
    """
    started = time.perf_counter()
    # Before the restore's census re-lists them: the steps some listing named (elastic
    # ones too), so that `_finish` can tell a newest step from a leftover.
    self._listed = {*self._ledger.ram, *self._ledger.persistent}
    if step is None and self.replicator_entry is not None:
      return self._from_replicator_entry(targets, single, started)
    # An explicit restore (MaxText's `restore(latest_step())` in managed mode too) takes the
    # place of the first one: a later restore(None) must not go back to the entry's step
    # and drop what the job saved since.
    self.replicator_entry = None
    return self._restore(step, targets, single, started)

  def _from_ram(self, step: int | None, targets: dict[str, Any], single: bool | None,
                started: float, *, tier: str | None = None, drop_newer: bool
                ) -> RamRestoreResult:
    """A RAM restore; when found, the restored timeline is recorded, then the step is
    re-protected where it is not in place."""
    result = self._ram.restore(step, targets, single)
    if result.found:
      # Listed from now on, whatever folders served it (another process count's, a set-aside
      # one): the write-back that makes it this job's own is still on the writer thread.
      self._ledger.add_ram([result.step])
      self._finish(result.step, tier or result.tier, started, drop_newer=drop_newer)
      self._ram.write_back(result.done)
    return result

  def _restore(self, step: int | None, targets: dict[str, Any], single: bool | None,
               started: float) -> Any:
    result = self._from_ram(step, targets, single, started, drop_newer=step is None)
    if result.found:
      return result.value
    persistent_step = result.persistent_step
    if persistent_step is not None:
      return self._from_persistent(persistent_step, targets, single, started,
                                   drop_newer=step is None)
    if step is not None:
      if result.tried:
        raise local_format.LocalTierError(
            f"Step {step} is in the RAM tier of every process but could not be used (corrupt "
            "or incomplete; see the warnings above) and the persistent tier does not have it.")
      raise FileNotFoundError(
          f"Step {step} is in neither tier: local steps (this process) {self._local.steps()}, "
          f"persistent steps {self._persistent.steps()}.")
    self._from_scratch(started)
    return None

  def _from_replicator_entry(self, targets: dict[str, Any], single: bool | None,
                             started: float) -> Any:
    """Managed mode, first restore(None): the step the replicator's entries name."""
    mine, self.replicator_entry = self.replicator_entry, None
    entry = handshake.entry_step(mine, self._local.steps(), self._summarize)
    if entry:
      # Newer local steps (a node that committed a step the others did not) belong to the
      # timeline the job abandons, as after any restore(None): kept, the next save of their
      # step number would find it already in RAM and raise, at every restart.
      result = self._from_ram(entry, targets, single, started, tier="replicator",
                              drop_newer=True)
      if result.found:
        return result.value
    # The usual plan where the entries disagree, cannot be read, or say "nothing" (0; an
    # entry cannot name step 0, which every node may hold): the newest step the cluster
    # holds, as `latest_step()` lists it (a resume by number agrees) and as Orbax's
    # replicator manager restores its latest local step. Starting from scratch dropped it.
    return self._restore(None, targets, single, started)

  def _from_persistent(self, step: int, targets: dict[str, Any], single: bool | None,
                       started: float, *, drop_newer: bool) -> Any:
    ledger = self._ledger
    restored = persistent_restore.restore(
        self._persistent, step, targets, single,
        lambda record, what: agreed_outcome.agree(
            record, ledger.process_index, ledger.process_count, {}, 0,
            lambda rnd: ledger.reduce(rnd, what)))
    self._finish(step, "persistent", started, drop_newer=drop_newer)
    return restored

  def _from_scratch(self, started: float) -> None:
    logging.info("orbax-mtc: no checkpoint in RAM (%s) or in %s: starting from scratch.",
                 self._local.directory, self._persistent.directory)
    # Local steps no other process shares belong to an earlier run: drop them, or this node
    # would skip saving those step numbers and a later restore could mix the two runs.
    self._delete_local(self._local.steps())
    self._writer.drain()  # copies in flight land before the drop
    self._store.drop_newer(-1)
    self._ledger.keep_ram(lambda _: False)
    self.last = RestoreInfo(step=None, tier="none", seconds=time.perf_counter() - started)

  def _drop_abandoned(self, step: int, *, every_newer: bool) -> None:
    # After restore(None), local steps newer than the agreed one exist on some nodes only and
    # belong to a timeline the job abandons: drop them so that they can neither be restored
    # later nor block saving those step numbers again. So after an explicit restore of the
    # newest step listed (`step = latest_step(); restore(step)`, Orbax's and MaxText's
    # resume): newer local steps are then leftovers no restore can use, and kept they made
    # the next save of their number raise, at every restart. An explicit restore of an older
    # step keeps them.
    listed = {*self._listed, *self._ledger.ram, *self._ledger.persistent}
    if every_newer or step >= max(listed, default=-1):
      self._delete_local([s for s in self._local.steps() if s > step])
      # Peer copies received before this restore are committed on the writer thread: let
      # them land first, or a newer one could be committed after the drop below.
      self._writer.drain()
      self._store.drop_newer(step)
      self._ledger.keep_ram(lambda s: s <= step)

  def after_other_restore(self, step: int) -> None:
    """The parent-style form's parent restored `step` (collective order: every process): the
    leftovers above it go as after a RAM restore of it."""
    self._listed = set()  # no census ran since: the ledger's lists are the listing
    self._drop_abandoned(step, every_newer=False)

  def ram_only(self, step: int | None, targets: dict[str, Any], single: bool | None) -> Any:
    """From RAM alone (the parent-style form, whose parent serves the rest).

    Returns:
      (found, value).
    """
    started = time.perf_counter()
    self._listed = {*self._ledger.ram, *self._ledger.persistent}
    result = self._from_ram(step, targets, single, started, drop_newer=step is None)
    return result.found, result.value

  def list_elastic_steps(self) -> None:
    """Adds to the agreed RAM steps those saved on another process count that an elastic
    restore can rebuild (collective)."""
    self._ledger.add_ram(self._ram.elastic_steps())

  def _finish(self, step: int, tier: str, started: float, *, drop_newer: bool) -> None:
    self._drop_abandoned(step, every_newer=drop_newer)
    self.last = RestoreInfo(step=step, tier=tier, seconds=time.perf_counter() - started)
    logging.info("orbax-mtc: restored step %d from the %s tier in %.2fs", step, tier,
                 self.last.seconds)
