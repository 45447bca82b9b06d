"""The one RAM restore executor: the saved layout is the case with nothing to move.

Every restore from RAM runs the same pipeline, whatever changed since the save (nothing, a
lost node, process ids permuted, another mesh, process count or device count), as PyTorch DCP
treats resharding as the general case:

1. **inventory** — the save census with the step asked for (reductions whose size does not
   grow with the cluster): the step, the faults and the step lists; each process lists every
   folder it holds, own or peer copy, named by saved rank, process count and layout digest
   (`sources.HostFolders`);
2. **plan** (`census`, reductions replaying `plan`'s rule) — the saves some host holds,
   newest first; per step, which saved ranks some process serves and which saves they cover;
   per saved rank of the chosen save, one serving process (its own folder first, then
   copies, load spread);
3. **fetch** (`attempt.StepAttempt`) — each process reads and verifies the folders its own
   shards come from; one stream exchange sends every process the saved tiles its target
   shards need, read from their files as they go (and its per-process items, which belong
   to its saved rank: rule 11);
4. **build** (`tiles.build`) — each target shard from the tiles covering it; a saved tile that
   is the shard is adopted without a copy; every received tile is checked against the
   checksum written at save time;
5. **outcome** — the `BuildRecord`s reduced (`outcome`). A damaged source (checksum, manifest,
   size) is excluded and the plan made again; a target that does not match is the caller's
   error everywhere; any other error is raised everywhere as `CheckpointError` (rule 10:
   nothing excluded, nothing deleted);
6. **write-back** (`writeback.WriteBack`) — a process whose step came from elsewhere, or every
   process when the layout changed, writes it into its own folder; what it replaces is set
   aside at that commit, never deleted first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement, item_args, process_state, reduction
from orbax_mtc.agreement import Status
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import format as local_format
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.restore import census, tiles
from orbax_mtc.restore import outcome as agreed_outcome
from orbax_mtc.restore import plan as restore_plan
from orbax_mtc.restore.attempt import Exclude, Lacking, Sources, StepAttempt
from orbax_mtc.restore.plan import COPY, HostReport
from orbax_mtc.restore.sources import HostFolders
from orbax_mtc.restore.writeback import Restored, WriteBack

ELASTIC, LOCAL, PEER = "elastic", "local", "peer"  # RestoreInfo.tier of a RAM restore
_MAX_CANDIDATES = 62  # saves a plan examines at most (the bits one CoverRecord had)


@dataclasses.dataclass(frozen=True)
class RamRestoreResult:
  """The outcome of `RamRestore.restore` (the same on every process but `tier`)."""

  found: bool
  value: Any  # the restored item, or Composite of items, when found
  step: int | None
  tier: str  # this process's: "local", "peer" or "elastic"
  tried: bool  # a RAM step was tried and could not be used
  persistent_step: int | None  # the persistent step to fall back to
  done: Restored | None = None  # what `write_back` needs, when found


class RamRestore:
  """Restores from the RAM tiers of the cluster.

  Args:
    me: this process.
    count: processes in the job now.
    local: this node's RAM tier.
    store: the peer copies this node holds.
    writer: the RAM tier's writer thread.
    ledger: the agreed step lists and faults.
    peers: the peer copies (sent again after a write-back).
    chunk_bytes: largest transfer chunk.
    window: transfer chunks in flight.
  """

  def __init__(self, *, me: int, count: int, local: local_store.LocalTier,
               store: peer_store.PeerStore, writer: RamWriter, ledger: StepLedger,
               peers: PeerCopies, chunk_bytes: int, window: int):
    self._me, self.count = me, count
    self._ledger, self._peers = ledger, peers
    self.folders = HostFolders(local, store, count, lambda: peers.enabled)
    self._attempt = StepAttempt(me=me, count=count, folders=self.folders, ledger=ledger,
                                chunk_bytes=chunk_bytes, window=window)
    self._write_back = WriteBack(me=me, writer=writer, peers=peers,
                                 on_error=ledger.note_local_error)

  # --------------------------------------------------------------------- the agreement

  def restore(self, step: int | None, targets: dict[str, Any],
              single: bool | None) -> RamRestoreResult:
    """Restores `step` (None: the newest the cluster can assemble) from RAM, if possible.

    Collective: every process calls it with the same step and targets. Returns what it did;
    the caller records it and drops what the restored timeline abandoned, then calls
    `write_back(result.done)`.

    Raises:
      ValueError: processes asked for different steps.
      local_format.AbstractStateMismatchError: the targets do not match what was saved (or
        lack a per-process item no copy of that step holds).
      agreement.CheckpointError: an error that proves no damage, on some process.
    """
    # Copies still in flight would race with the folders this restore reads and rewrites.
    self._peers.progress(block=True)
    ledger = self._ledger
    # The step asked for, the faults and the step lists: the save's census (its size does
    # not grow with the cluster), with the step asked for in place of the step saved.
    answer = ledger.agree_save(agreement.SaveRecord(
        step=-1 if step is None else int(step), fault=ledger.take_fault(),
        inventory=ledger.inventory()), "restore", restoring=True)
    if answer.steps_error is not None:
      raise ValueError(answer.steps_error)
    for p, fault in answer.local.items():
      # An earlier write that failed left nothing committed: the plan below does not use it.
      logging.warning("orbax-mtc: process %d: an earlier local write failed (%s: %s); "
                      "restoring from what the cluster holds.", p, fault.kind, fault.message)
    ledger.forgive()
    ledger.adopt_answer(answer)
    persistent = ledger.persistent
    if step is not None:
      persistent_step = step if step in persistent else None
      min_step = None
    else:
      persistent_step = min_step = persistent[-1] if persistent else None
    return self._restore(step, targets, single, self.folders.safe_report(), min_step,
                         persistent_step)

  def _restore(self, step: int | None, targets: dict[str, Any], single: bool | None,
               report: HostReport, min_step: int | None,
               persistent_step: int | None) -> RamRestoreResult:
    per_process = tiles.process_names(targets)
    excluded: Sources = set()
    dropped: set[census.Save] = set()  # saves every folder of which failed
    tried, lacking = False, None
    while True:
      mine = census.holdings(report, self._me, requested_step=step, min_step=min_step,
                             excluded=excluded, dropped=dropped)
      chosen, cover, examined = self._choose(mine, per_process)
      if lacking is not None and (chosen is None or chosen.step != lacking.step):
        raise lacking.error  # no other folder of that step has the item: the caller's error
      if chosen is None or cover is None:
        self._explain_lost_items(step, per_process, examined, persistent_step)
        # "tried": a step the cluster could assemble was found unusable (not merely absent).
        return RamRestoreResult(False, None, None, "", tried or any(ok for _, ok in examined),
                                persistent_step)
      tried = True
      plan = restore_plan.ElasticPlan(chosen.step, chosen.count, chosen.digest,
                                      census.agree_servers(
                                          mine, self._me, chosen, cover, self.count,
                                          self._reduce("planning a restore"), []))
      try:
        attempt = self._attempt.run(plan, targets, single, per_process)
      except Exclude as e:
        # Named sources go; when they were out already (or none was named), every folder of
        # this save goes, so each attempt excludes something and the loop ends.
        fresh = e.sources - excluded
        if fresh:
          excluded |= fresh
        else:
          dropped.add(chosen.save)
        continue
      except Lacking as e:
        if e.sources <= excluded:
          raise e.error from None
        lacking, excluded = e, excluded | e.sources
        continue
      built = attempt.built
      restored = built.restored
      if per_process:
        restored = self._settle(plan.step, restored)
      # Another layout (or rank order: a folder's bytes have no owner, rule 11): every
      # process writes the step anew; else those whose own current folder did not serve.
      rewritten = attempt.outcome.moved or any(
          kind != COPY and process != rank for rank, process, kind in plan.servers)
      recovered = tuple(range(self.count)) if rewritten else attempt.outcome.not_in_place
      tier = ELASTIC if rewritten else PEER if self._me in recovered else LOCAL
      if single or (single is None and built.default_item):
        value = restored[item_args.DEFAULT_ITEM]
      else:
        value = ocp.args.Composite(**restored)
      return RamRestoreResult(True, value, plan.step, tier, False, persistent_step,
                              Restored(plan.step, built, rewritten, recovered))

  def _reduce(self, what: str, listing: bool = False) -> census.Reduce:
    return lambda rnd: self._ledger.reduce(rnd, what, listing=listing)

  def _choose(self, mine: census.Mine, per_process: list[str]
              ) -> tuple[census.Agreed | None, census.Cover | None,
                         list[tuple[census.Agreed, bool]]]:
    """The save to restore, its cover answer and the saves examined (census.choose); with
    per-process items, only a save of every rank of this process count."""
    return census.choose(
        mine, self._me, self._reduce("planning a restore"),
        lambda _, agreed: self._facts(mine, agreed),
        usable=lambda a: not per_process or self._every_rank(a),
        refuse=lambda newest: per_process and self._refuse_other_count(per_process, newest),
        limit=_MAX_CANDIDATES)

  def _facts(self, mine: census.Mine, agreed: list[census.Agreed]
             ) -> tuple[list[bool], list[bool]]:
    """Per save: whether this process read its layout, and found it covered by the
    available ranks."""
    known, covered = [False] * len(agreed), [False] * len(agreed)
    for i, candidate in enumerate(agreed):
      manifest = self._layout_of(mine, candidate)
      if manifest is None or tiles.digest(manifest) != candidate.digest:
        continue
      known[i] = True
      covered[i] = restore_plan.covered(tiles.holder_sets(manifest), candidate.available)
    return known, covered

  def _layout_of(self, mine: census.Mine,
                 candidate: census.Agreed) -> local_format.StepManifest | None:
    """A manifest of `candidate` this node holds, or None."""
    for rank, kinds in sorted(mine.get(candidate.save, {}).items()):
      for kind in kinds:
        try:
          return self.folders.manifest(kind, rank, candidate.step, candidate.count,
                                       candidate.digest)
        except local_format.LocalTierError:
          continue
    return None

  def _every_rank(self, candidate: census.Agreed) -> bool:
    """Per-process items belong to the process index that saved them (rule 11): the save
    must be of this process count with every saved rank's folder available."""
    return candidate.count == self.count and candidate.held == self.count

  def _refuse_other_count(self, names: list[str], newest: census.Agreed) -> None:
    """The newest step RAM holds was saved by another process count: it can be rebuilt,
    but not the per-process items, which belong to the processes that saved them."""
    if newest.count == self.count:
      return
    raise local_format.AbstractStateMismatchError(
        f"Step {newest.step} can only be restored here by rebuilding it from RAM on another "
        f"process count (saved by {newest.count} processes; this job has {self.count}), and "
        f"item(s) {names} hold per-process state (a data iterator's position), which belongs "
        "to the process that saved it. Restore without these items (leave them out of the "
        "restore args) and position the iterators yourself, or restart with the process count "
        f"that saved step {newest.step}.")

  def write_back(self, done: Restored) -> None:
    """After a successful `restore` (collective): re-protects the step where it is not in
    place."""
    self._write_back.run(done)

  def _explain_lost_items(self, step: int | None, names: list[str],
                          examined: list[tuple[census.Agreed, bool]],
                          persistent_step: int | None) -> None:
    """`restore(step)` of a step whose arrays the cluster holds but not every process's own
    per-process items (only twins' folders are left for some): say which, not 'not found'."""
    if step is None or not names or persistent_step == step:
      return
    for candidate, ok in examined:
      if ok and candidate.count == self.count:
        lost = sorted(set(range(self.count)) - candidate.available)
        raise local_format.MissingItemError(
            f"Step {step} can be rebuilt from RAM only from other processes' folders, which "
            f"hold the arrays but not the per-process item(s) {names} of process(es) {lost} "
            "(their own folders and the copies of them are gone), and the persistent tier "
            f"does not have it. Restore step {step} without these items and position the "
            "iterators yourself, or call restore(None), which takes the newest step that "
            "still has them.", names[0])

  def elastic_steps(self) -> list[int]:
    """Steps the listing lacks that the cluster can rebuild here: saved by a job of another
    process count, or held only in set-aside folders (an older layout of this count).

    Collective (the saves round, and a tiers and a cover round only when such saves exist):
    what `all_steps()` lists besides the steps of this job's own folders, so that
    `restore(latest_step())` finds every step `restore(None)` can (rule 8: the listing and
    the saves agreed are the same on every process).
    """
    reduce = self._reduce("listing RAM steps the step agreements lack", True)
    mine = census.holdings(self.folders.safe_report(), self._me)
    listed = set(self._ledger.ram)
    unlisted = tuple(s for s in census.agree_saves(mine, self._me, reduce, [])
                     if s[0] not in listed)[:_MAX_CANDIDATES]
    steps: set[int] = set()
    for batch in census.tiers_batches(unlisted):  # bounded rounds, whatever the host count
      agreed = census.read_tiers(reduce(reduction.Round(
          mine, self._me, lambda m, p, b=batch: census.tiers_parts(m, p, b))), batch)
      known, covered = self._facts(mine, agreed)
      covers = census.read_cover(reduce(reduction.Round(
          mine, self._me, lambda m, _, a=agreed, k=known, c=covered:
          census.cover_parts(m, a, k, c))), len(agreed))
      steps |= {a.step for a, c in zip(agreed, covers, strict=True) if c.covered}
    return sorted(steps)

  def _settle(self, step: int, restored: dict[str, Any]) -> dict[str, Any]:
    """Sets the saved iterator states, now that every process has built the step; a state an
    iterator refuses (another shard layout, say) is raised on every process alike."""
    problem = ""
    try:
      restored = process_state.settle(restored)
    except Exception as e:  # noqa: BLE001 - agreed below, raised everywhere
      problem = f"{type(e).__name__}: {e}"
    agreed = agreed_outcome.agree(agreement.BuildRecord(
        status=Status.MISMATCH if problem else Status.OK, message=problem, in_place=True),
        self._me, self.count, {}, 0, self._reduce(f"setting the data iterators of step {step}"))
    if Status.MISMATCH in agreed.said:
      process, message = agreed.said[Status.MISMATCH]
      raise local_format.AbstractStateMismatchError(
          f"process {process}: the iterator refused the state saved with step {step} "
          f"({message}). Restore into an iterator built as the one that was saved (same "
          "data source, sampler and shard), or leave the item out.")
    return restored

