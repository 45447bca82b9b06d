"""Executes a RAM restore plan: read, transfer, build the arrays, write back.

`restore_plan` decides (pure): the newest step every node can get, and from where (its own
folder, a twin's, or a peer's copy). `RamRestore` carries that out, as PyTorch DCP splits a
planner from an executor:

1. one all-gather of a `RestoreRecord` (the step asked for, what each node holds);
2. per candidate step, newest first: the nodes that lost it get it through one stream
   exchange (`peers.exchange`); every node builds its arrays (checksums verified) and one
   all-gather of a `BuildRecord` says whether all succeeded;
3. a source that failed is excluded and the plan is made again; a target that does not
   match what was saved is the caller's error, raised on every process, and nothing is
   deleted;
4. after success, a node that got its step from elsewhere writes it back into its own
   folder, and the copies involving it are sent again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement, elastic_exec, item_args, process_state, restore_plan
from orbax_mtc.agreement import Status
from orbax_mtc.elastic_plan import HostReport
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import aside
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import exchange, replication
from orbax_mtc.peers import store as peer_store
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.ram_writer import RamWriter

# A step's bytes as received or read: its manifest and data buffer.
StepBytes = tuple[local_format.StepManifest, np.ndarray]


class _Reshard(Exception):
  """Some process's target shards lie elsewhere than saved (agreed): restore elastically."""


class _LackingItem(Exception):
  """Some processes' sources lack a per-process item asked for (agreed): a folder rebuilt
  from a twin has none, while a peer's copy of the node's own folder may still have it."""

  def __init__(self, error: local_format.AbstractStateMismatchError, step: int,
               sources: set[tuple[int, int, int]]):
    super().__init__(str(error))
    self.error, self.step, self.sources = error, step, sources


@dataclasses.dataclass(frozen=True)
class Built:
  """One node's attempt to build the restore targets from one source."""

  # OK, MISMATCH (the caller's target), UNUSABLE (damaged: try another source) or FAILED
  # (any other error: raised on every process)
  status: Status
  value: Any = None  # (item name -> restored tree, saved as a single default item)
  message: str = ""


@dataclasses.dataclass(frozen=True)
class RamRestoreResult:
  """The outcome of `RamRestore.restore` (the same on every process)."""

  found: bool
  value: Any  # the restored item, or Composite of items, when found
  plan: restore_plan.RestorePlan
  tried: bool  # a RAM step was tried and could not be used


class RamRestore:
  """Restores from the RAM tiers of the cluster.

  Args:
    me: this process.
    local: this node's RAM tier.
    store: the peer copies this node holds.
    writer: the RAM tier's writer thread.
    ledger: the agreed step lists and faults.
    peers: the peer copies (twin groups; copies sent again after a recovery).
    chunk_bytes: largest transfer chunk.
    window: transfer chunks in flight.
    elastic: the restore of steps saved on another layout.
  """

  def __init__(self, *, me: int, local: local_store.LocalTier, store: peer_store.PeerStore,
               writer: RamWriter, ledger: StepLedger, peers: PeerCopies, chunk_bytes: int,
               window: int, elastic: elastic_exec.ElasticRestore):
    self._me = me
    self._elastic = elastic
    self._local = local
    self._store = store
    self._writer = writer
    self._ledger = ledger
    self._peers = peers
    self._chunk_bytes = chunk_bytes
    self._window = window

  def restore(self, step: int | None, targets: dict[str, Any], single: bool | None,
              finish: Callable[[int, str], None]) -> RamRestoreResult:
    """Restores `step` (None: the newest the cluster can assemble) from RAM, if possible.

    Collective: every process calls it with the same step and targets.

    Args:
      step: the step asked for, or None.
      targets: item name -> target tree (None: a JSON item).
      single: a single-item restore (None: as the step was saved).
      finish: `finish(step, tier)` after the step was built on every process, before it
        is written back where it was missing.

    Raises:
      ValueError: processes asked for different steps.
      local_format.AbstractStateMismatchError: the targets do not match what was saved.
    """
    # Copies still in flight would race with the folders this restore reads and rewrites.
    self._peers.progress(block=True)
    ledger = self._ledger
    report = self._elastic.safe_report()
    records = ledger.agree(agreement.RestoreRecord(
        requested_step=-1 if step is None else int(step), fault=ledger.take_fault(),
        inventory=self._native(ledger.inventory(), report), elastic=report.encode()),
        "restore")
    asked = [r.requested_step for r in records]
    if len(set(asked)) > 1:
      raise ValueError(
          "restore() was called with different steps on different processes: " + ", ".join(
              f"process {p}: {'None' if s < 0 else s}" for p, s in enumerate(asked)) +
          ". Every process must restore the same step; use step = mgr.latest_step(), which "
          "is the same on every process.")
    for p, fault in agreement.faults(records).items():
      # An earlier write that failed left nothing committed: the plan below does not use it.
      logging.warning("orbax-mtc: process %d: an earlier local write failed (%s: %s); "
                      "restoring from what the cluster holds.", p, fault.kind, fault.message)
    ledger.forgive()
    reports = elastic_exec.decode_reports([r.elastic for r in records])
    inventories = ledger.adopt([r.inventory for r in records])
    groups = sets = None
    # Targets that take their shape from the checkpoint (SavedLeaf) cannot say which shards
    # twins share before a step is read: then every node restores from its own folder.
    if self._peers.topology is not None and not any(
        isinstance(leaf, local_read.SavedLeaf)
        for tree in targets.values() for leaf in jax.tree_util.tree_leaves(tree)):
      sets = self._peers.shard_sets(targets)
      # A twin holds the same shards but not the same per-process state (a data iterator's
      # position): with such an item, a node's step comes from its own folder or a copy of it.
      if not item_args.process_targets(targets):
        groups = replication.shard_groups(sets)
    excluded: set[tuple[int, int, int]] = set()
    failed_steps: set[int] = set()
    lacking: _LackingItem | None = None
    while True:
      plan = restore_plan.plan_restore(inventories, ledger.persistent, step,
                                       shard_groups=groups, excluded=excluded)
      candidates = [a for a in plan.candidates if a.step not in failed_steps]
      newest = candidates[0].step if candidates else None
      if lacking is not None and newest != lacking.step:
        raise lacking.error  # no other source of that step has the item: the caller's error
      if self._elastic_first(reports, step, newest, ledger.persistent):
        return self._restore_elastic(step, targets, single, reports, plan, finish,
                                     bool(failed_steps or excluded))
      if not candidates:
        self._explain_twin_only(step, inventories, sets, excluded, targets)
        tried = bool(plan.local_candidates or failed_steps or excluded)
        return RamRestoreResult(False, None, plan, tried)
      assembly = candidates[0]
      try:
        built, received, exclusions = self.execute(assembly, targets, single)
      except _Reshard:
        return self._restore_elastic(step, targets, single, reports, plan, finish, False)
      except _LackingItem as e:
        if e.sources <= excluded:
          raise e.error from None
        lacking, excluded = e, excluded | e.sources
        continue
      if built is not None:
        restored, default_item = built
        if item_args.process_targets(targets):
          restored = self._settle(assembly.step, restored)
        # Per process: "peer" when this node's bytes came from a twin or a peer's copy.
        mine = assembly.sources[self._me].kind
        finish(assembly.step, "local" if mine == restore_plan.OWN else "peer")
        if assembly.transfers:
          self._write_back(assembly, received, sets)
        if single or (single is None and default_item):
          return RamRestoreResult(True, restored[item_args.DEFAULT_ITEM], plan, False)
        return RamRestoreResult(True, ocp.args.Composite(**restored), plan, False)
      new = set(exclusions) - excluded
      if not new:
        failed_steps.add(assembly.step)
      excluded |= new

  def _explain_twin_only(self, step: int | None, inventories: list[agreement.Inventory],
                         sets: list | None, excluded: set[tuple[int, int, int]],
                         targets: dict[str, Any]) -> None:
    """A step listed by `all_steps()` that only twins' folders can assemble has no
    per-process state for the nodes that lost theirs: name the item and the nodes instead of
    'not found' (the same on every process: everything here is agreed)."""
    names = sorted(item_args.process_targets(targets))
    if step is None or sets is None or not names or step in self._ledger.persistent:
      return
    with_twins = restore_plan.plan_restore(inventories, self._ledger.persistent, step,
                                           shard_groups=replication.shard_groups(sets),
                                           excluded=excluded)
    assembly = next((a for a in with_twins.candidates if a.step == step), None)
    if assembly is None:
      return
    lost = [p for p, source in enumerate(assembly.sources) if source.kind == restore_plan.TWIN]
    raise local_format.MissingItemError(
        f"Step {step} can be rebuilt from RAM only from data-parallel twins' folders, which "
        f"hold the arrays but not the per-process item(s) {names} of process(es) {lost} (their "
        "own folders and the copies of them are gone), and the persistent tier does not have "
        f"it. Restore step {step} without these items and position the iterators yourself, "
        "or call restore(None), which takes the newest step that still has them.", names[0])

  def _settle(self, step: int, restored: dict[str, Any]) -> dict[str, Any]:
    """Sets the saved iterator states, now that every process has built the step; a state an
    iterator refuses (another shard layout, say) is raised on every process alike."""
    problem = ""
    try:
      restored = process_state.settle(restored)
    except Exception as e:  # noqa: BLE001 - agreed below, raised everywhere
      problem = f"{type(e).__name__}: {e}"
    outcomes = self._ledger.agree(agreement.BuildRecord(
        status=Status.MISMATCH if problem else Status.OK, message=problem),
        f"setting the data iterators of step {step}")
    refused = [(p, o.message) for p, o in enumerate(outcomes) if o.status != Status.OK]
    if refused:
      process, message = refused[0]
      raise local_format.AbstractStateMismatchError(
          f"process {process}: the iterator refused the state saved with step {step} "
          f"({message}). Restore into an iterator built as the one that was saved (same "
          "data source, sampler and shard), or leave the item out.")
    return restored

  def _native(self, inventory: agreement.Inventory, report: HostReport) -> agreement.Inventory:
    """The inventory less the folders saved on another layout of processes (another count,
    or another rank's folder here): the ordinary plan assumes rank = folder."""
    count = self._elastic.count
    foreign_own = {r.step for r in report.own if self._elastic.is_primary(r) and (
        r.count != count or r.rank != self._me)}
    foreign_copies = {(r.rank, r.step) for r in report.copies if r.count != count}
    return dataclasses.replace(
        inventory, own_steps=tuple(s for s in inventory.own_steps if s not in foreign_own),
        copies=tuple(c for c in inventory.copies if tuple(c) not in foreign_copies))

  def _elastic_first(self, reports: list[HostReport], step: int | None, newest: int | None,
                     persistent: tuple[int, ...]) -> bool:
    """Whether a folder saved on another layout of processes holds a step the ordinary plan
    cannot offer and that is newer than what it offers (and than the persistent tier)."""
    floor = max([s for s in (newest, persistent[-1] if persistent else None) if s is not None],
                default=None)
    count = self._elastic.count
    for process, report in enumerate(reports):
      # A folder of another process count, or this count's folder held by another process
      # than the rank that saved it (process ids permuted at restart: rule 11, bytes have no
      # owner): only the general plan reads it.
      for ref in [r for r in report.own if r.count != count or r.rank != process] + [
          r for r in report.copies if r.count != count]:
        if step is not None and ref.step != step:
          continue
        if floor is None or ref.step > floor or (ref.step == floor and newest is None):
          return True
    return False

  def _restore_elastic(self, step: int | None, targets: dict[str, Any], single: bool | None,
                       reports: list[HostReport], plan: restore_plan.RestorePlan,
                       finish: Callable[[int, str], None], tried: bool) -> RamRestoreResult:
    persistent = self._ledger.persistent
    result = self._elastic.restore(step, targets, single, reports,
                                   persistent[-1] if persistent else None, finish)
    return RamRestoreResult(result.found, result.value, plan, tried or result.tried)

  def elastic_steps(self) -> list[int]:
    """Steps saved on another process count the cluster can rebuild (collective)."""
    return self._elastic.listable_steps()

  def build(self, step: int, targets: dict[str, Any], single: bool | None,
            source: StepBytes | None = None,
            own_crcs: dict[tuple[int, int], int] | None = None) -> Built:
    """Builds the targets from this node's folder of `step`, or from `source`: a step that
    came from a twin or a peer, or (with `own_crcs`, its checksums) this node's own step
    already read. Never raises, so that every process reaches the agreement on the outcome.
    """
    try:
      crcs: dict[tuple[int, int], int] = dict(own_crcs or {})
      where = str(self._local.directory / str(step))
      if source is None:
        manifest = self._local.manifest(step)
        data = local_read.read_data(self._local.directory / str(step), manifest, crcs)
      else:
        manifest, data = source
        if own_crcs is None:
          where = f"step {step} received from another node"
      if single is None:  # args omitted: follow how it was saved
        targets = item_args.as_saved(targets, manifest.default_item)
      restored = local_read.arrays_from_buffer(data, manifest, targets, where, crcs=crcs)
      return Built(Status.OK, (restored, manifest.default_item))
    except local_read.ReshardNeeded as e:
      return Built(Status.RESHARD, message=str(e))
    except local_format.AbstractStateMismatchError as e:
      return Built(Status.MISMATCH, message=str(e))
    except local_format.LocalTierError as e:  # proof of damage: try another source
      return Built(Status.UNUSABLE, message=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - not proof of damage: agreed, raised everywhere
      logging.exception("orbax-mtc: error building step %d", step)
      return Built(Status.FAILED, message=f"{type(e).__name__}: {e}")

  def execute(self, assembly: restore_plan.Assembly, targets: dict[str, Any],
              single: bool | None) -> tuple[Any, StepBytes | None, set[tuple[int, int, int]]]:
    """Executes one assembly: transfers to nodes that lost the step, then every node builds
    its arrays.

    Returns:
      (the built value or None, what this node received, sources to exclude when it failed);
      whether it failed is the same on every process.
    """
    me, step = self._me, assembly.step
    received: StepBytes | None = None
    # A twin that serves its own folder and restores from it reads (and checks) it once.
    own_read: replication.OwnStep | None = None
    if assembly.transfers:
      received, own_read, failed = self._transfer(assembly)
      if failed:
        return None, None, failed
    mine = assembly.sources[me]
    if mine.kind != restore_plan.OWN and received is None:
      built = Built(Status.UNUSABLE, message="nothing usable received")
    elif mine.kind == restore_plan.OWN and own_read is not None:
      built = self.build(step, targets, single, own_read[:2], own_read[2])
    else:
      built = self.build(step, targets, single, received)
    outcomes = self._ledger.agree(agreement.BuildRecord(status=built.status,
                                                        message=built.message),
                                  f"building step {step}")
    if all(b.status == Status.OK for b in outcomes):
      return built.value, received, set()
    mismatched = [p for p, b in enumerate(outcomes) if b.status == Status.MISMATCH]
    if not mismatched and any(b.status == Status.RESHARD for b in outcomes):
      raise _Reshard()  # the same on every process: rebuild on the targets' layout
    if mismatched:
      # The caller's error, not a bad copy: the same error everywhere, and nothing deleted.
      culprit = mismatched[0]
      error = local_format.agreed_mismatch(culprit, outcomes[culprit].message, step)
      per_process = item_args.process_targets(targets)
      missing = [local_format.agreed_mismatch(p, outcomes[p].message, step) for p in mismatched]
      if all(isinstance(m, local_format.MissingItemError) and m.item in per_process
             for m in missing):
        raise _LackingItem(error, step,
                           {(assembly.sources[p].holder, p, step) for p in mismatched})
      raise error
    failed = {p: b.message for p, b in enumerate(outcomes) if b.status == Status.FAILED}
    if failed:
      # An error that proves nothing about the bytes (a device out of memory, an interrupted
      # read): excluding the source would roll back to an older step and drop this one.
      raise agreement.CheckpointError(f"restoring step {step} from RAM", failed)
    bad = [p for p, b in enumerate(outcomes) if b.status != Status.OK]
    logging.warning("orbax-mtc: step %d unusable on process(es) %s (%s); trying another source, "
                    "an older step or the persistent tier.", step, bad,
                    "; ".join(f"process {p}: {outcomes[p].message}" for p in bad))
    return None, None, {(assembly.sources[p].holder, p, step) for p in bad}

  def _transfer(self, assembly: restore_plan.Assembly
                ) -> tuple[StepBytes | None, replication.OwnStep | None,
                           set[tuple[int, int, int]]]:
    """Sends the step to the nodes that lost it (one stream exchange). Returns (what this
    node received, its own step if it read it to serve it, failed sources)."""
    me, step = self._me, assembly.step
    transfers = assembly.transfers
    edges = [(holder, dest) for holder, dest, _ in transfers]
    own_read: replication.OwnStep | None = None
    outgoing: dict[int, peer_stream.OutgoingStream] = {}
    sizes = np.zeros((len(transfers),), dtype=np.int64)
    problems: list[str] = []
    for j, (holder, dest, kind) in enumerate(transfers):
      if holder != me:
        continue
      try:
        if kind == "twin" and own_read is None:
          own_read = replication.read_own(self._local, step)
        outgoing[dest] = replication.outgoing_step(
            kind, dest, step, self._local, self._store, own_read)
        sizes[j] = outgoing[dest].nbytes
      except Exception as e:  # noqa: BLE001 - every failure is agreed below, never raised
        problems.append(f"to process {dest} from its {kind}: {type(e).__name__}: {e}")
        sizes[j] = -1
    served = agreement.ServeRecord(status=Status.FAILED if problems else Status.OK,
                                   message="; ".join(problems))
    buffers, sink_for = replication.receive_buffers()
    result = exchange.exchange(
        edges, me, outgoing, sizes, served,
        lambda row: self._ledger.allgather(row, f"serving step {step}"),
        proceed=lambda _, agreed: bool((agreed >= 0).all()), sink_for=sink_for,
        chunk_limit=self._chunk_bytes, window=self._window)
    for p, record in enumerate(result.records):
      if record.status != Status.OK:
        logging.warning("orbax-mtc: process %d cannot serve step %d: %s", p, step,
                        record.message)
    if result.transfer is None:
      return None, own_read, {(*edges[j], step) for j in result.failed_edges()}
    result.transfer.run()
    mine = assembly.sources[me]
    if mine.kind == restore_plan.OWN:
      return None, own_read, set()
    try:
      manifest, data = peer_stream.received_step(buffers[mine.holder])
      # A step stream's header names no step of its own: check the manifest's.
      local_format.validate_for(manifest, where=f"step {step} from process {mine.holder}",
                              step=step)
      return (dataclasses.replace(manifest, process_index=me), data), own_read, set()
    except Exception as e:  # noqa: BLE001 - an unusable copy is agreed when building
      logging.warning("orbax-mtc: step %d from process %d is unusable: %s", step,
                      mine.holder, e)
      return None, own_read, set()

  def _write_back(self, assembly: restore_plan.Assembly, received: StepBytes | None,
                  sets: list | None) -> None:
    """A node that got its step from elsewhere writes it back into its own folder, and the
    copies that involve recovered nodes are sent again (at the next save or
    `replicate_pending`)."""
    step = assembly.step
    if received is not None:
      manifest, data = received
      staged = local_staging.StagedStep.from_buffer(step, data, manifest.data_size, manifest.items,
                                                 manifest.default_item)
      # Its own folder, if any, was unusable: set aside once the good copy is committed
      # (rule 10), never deleted before.
      self._writer.write(staged, background=True, replace=aside.DAMAGED)
    if sets is not None:
      self._peers.schedule_recovery(step, sets, assembly.recovered)
