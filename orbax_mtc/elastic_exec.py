"""Executes an elastic restore: a RAM step saved on another mesh or process count.

`elastic_plan` decides (pure); `ElasticRestore` carries it out:

1. every process reports the folders it holds, own and peer copies, each named by its saved
   rank, process count and layout digest (`report`, part of the restore's one agreement);
2. the candidates (newest first) are checked for coverage by the processes that hold their
   layout (the manifests' `tiles`), one all-gather of two bit masks;
3. for the newest covered save, each process loads and verifies the folders it serves; one
   stream exchange sends every process the tiles its new shards need and it does not serve
   itself (a process serving nothing also gets the step's manifest, for the tree and JSON
   items); the receiver checks every tile's checksum and that its shards are covered exactly
   once;
4. one all-gather of the outcome: a bad folder or tile is excluded and the plan made again
   (then an older step), a target that does not match is the caller's error everywhere;
5. after success every process writes the step back into its own folder in the new layout
   (when the restore read every item) and its peer copies are sent again, so the next save
   is an ordinary one. The old layout's folder is set aside at the new one's commit and its
   copies go only after the new layout's first copies are out (rule 10).

What travels and how new shards are assembled from saved tiles is `elastic_tiles`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement, elastic_plan, elastic_tiles, item_args
from orbax_mtc.agreement import Status
from orbax_mtc.elastic_plan import OWN, FolderRef, HostReport
from orbax_mtc.elastic_tiles import digest, holder_sets
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import aside
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local import store as local_store
from orbax_mtc.local.format import StepManifest
from orbax_mtc.peers import exchange
from orbax_mtc.peers import store as peer_store
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.ram_writer import RamWriter

TIER = "elastic"  # RestoreInfo.tier of a step rebuilt on another layout
_MAX_CANDIDATES = 62  # candidates whose coverage one agreement decides (bits of an int64)

# ----------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class ReportRecord:
  """This node's elastic report, alone (the listing at start-up)."""

  report: bytes = agreement.field(agreement.Blob(agreement.ELASTIC_REPORT_BYTES), b"")


def decode_reports(raws: list[bytes]) -> list[HostReport]:
  """The gathered reports; an unreadable one counts as holding nothing."""
  return elastic_plan.decode_reports(raws, lambda p, e: logging.warning(
      "orbax-mtc: process %d's elastic report was unreadable (%s) and is ignored", p, e))


@dataclasses.dataclass(frozen=True)
class CoverRecord:
  """Per candidate (bit i), whether this process holds its layout and finds it covered."""

  known: int = agreement.field(agreement.Int(), 0)
  covered: int = agreement.field(agreement.Int(), 0)


@dataclasses.dataclass(frozen=True)
class ServeRecord:
  """Whether this process could load the folders it serves; the saved ranks it could not."""

  status: Status = agreement.field(agreement.EnumCodec(Status), Status.OK)
  failed_ranks: tuple[int, ...] = agreement.field(agreement.Steps(32), ())
  message: str = agreement.field(agreement.Text(600), "")


@dataclasses.dataclass(frozen=True)
class BuildRecord:
  """One process's outcome; a bad tile names the process and saved rank that sent it."""

  status: Status = agreement.field(agreement.EnumCodec(Status), Status.OK)
  bad_process: int = agreement.field(agreement.Int(), -1)
  bad_rank: int = agreement.field(agreement.Int(), -1)
  message: str = agreement.field(agreement.Text(1200), "")


@dataclasses.dataclass(frozen=True)
class ElasticResult:
  """The outcome of `ElasticRestore.restore` (the same on every process)."""

  found: bool
  value: Any
  step: int | None
  tried: bool


# ----------------------------------------------------------------------------- executor


class ElasticRestore:
  """Restores a RAM step saved on another layout.

  Args:
    me: this process.
    count: processes in the job now.
    local: this node's RAM tier.
    store: the peer copies this node holds.
    writer: the RAM tier's writer thread (the write-back).
    ledger: the agreed step lists (its all-gather).
    peers: the peer copies (sent again after the write-back).
    chunk_bytes: largest transfer chunk.
    window: transfer chunks in flight.
  """

  def __init__(self, *, me: int, count: int, local: local_store.LocalTier,
               store: peer_store.PeerStore, writer: RamWriter, ledger: StepLedger,
               peers: PeerCopies, chunk_bytes: int, window: int):
    self._me, self.count = me, count
    self._local, self._store, self._writer = local, store, writer
    self._ledger, self._peers = ledger, peers
    self._chunk_bytes, self._window = chunk_bytes, window
    self._own_folders: dict[FolderRef, Path] = {}  # of the last report

  # --------------------------------------------------------------------- report

  def _own_dir(self, step: int) -> Path:
    return self._local.directory / str(step)

  def _copy_dir(self, rank: int, step: int) -> Path:
    return self._store.source_dir(rank) / str(step)

  def _own_folder(self, step: int, rank: int | None, digest_value: int) -> Path:
    """The own folder (current or set aside by a replacement) of a step's save with this
    layout digest, saved by `rank` (None: any rank)."""
    for ref, folder in self._own_folders.items():
      if (ref.step, ref.digest) == (step, digest_value) and rank in (None, ref.rank):
        return folder
    return self._own_dir(step)

  def is_primary(self, ref: FolderRef) -> bool:
    """Whether `ref` (of the last report) is the step's current folder `<local>/<step>`,
    not a replaced layout kept aside."""
    return self._own_folders.get(ref) == self._own_dir(ref.step)

  def report(self) -> HostReport:
    """The folders this node can serve, named by saved rank, count and layout digest.

    Reads only manifests; a folder that cannot be read or was saved without a layout is left
    out (it cannot serve an elastic restore). Own folders include the layouts a write-back
    set aside (`local.aside`): until the step is retired they still serve it.
    """
    own: list[FolderRef] = []
    self._own_folders = {}
    folders = [(step, self._own_dir(step)) for step in self._local.steps()]
    folders += aside.replaced_folders(self._local.directory)
    for step, folder in folders:
      ref = self._ref(folder, step, None)
      if ref is not None and ref not in self._own_folders:
        own.append(ref)
        self._own_folders[ref] = folder
    held = {(ref.step, ref.digest) for ref in own}
    copies: list[FolderRef] = []
    for source, step in self._store.copies():
      ref = self._ref(self._copy_dir(source, step), step, source)
      if ref is None:
        continue
      try:
        # Its shards marked "in my own folder" need an own folder of the same save.
        if self._store.meta(source, step).needs_own_step and (step, ref.digest) not in held:
          continue
      except local_format.LocalTierError:
        continue
      copies.append(ref)
    report = HostReport(own=tuple(own), copies=tuple(copies))
    # The agreement has room for agreement.ELASTIC_REPORT_BYTES: drop the oldest steps first.
    while len(report.encode()) > agreement.ELASTIC_REPORT_BYTES:
      oldest = min(ref.step for ref in report.own + report.copies)
      report = HostReport(own=tuple(r for r in report.own if r.step != oldest),
                          copies=tuple(r for r in report.copies if r.step != oldest))
    return report

  @staticmethod
  def _ref(folder: Path, step: int, source: int | None) -> FolderRef | None:
    try:
      manifest = local_store.read_manifest(folder, process_index=source)
    except local_format.LocalTierError:
      return None
    value = digest(manifest)
    if value is None or manifest.step != step:
      return None
    return FolderRef(step, manifest.process_count, manifest.process_index, value)

  def safe_report(self) -> HostReport:
    """`report`, or an empty one when this node's folders cannot be listed."""
    try:
      return self.report()
    except Exception:  # noqa: BLE001 - an unreadable folder only loses the elastic choices
      logging.exception("orbax-mtc: cannot list this node's folders for an elastic restore")
      return HostReport()

  def listable_steps(self) -> list[int]:
    """Steps saved by a job of another process count that the cluster can rebuild here.

    Collective (one all-gather, and one more only when such folders exist): what
    `all_steps()` lists besides the steps of this job's own layout, so that
    `restore(latest_step())` finds them as `restore(None)` does.
    """
    records = self._ledger.agree(ReportRecord(report=self.safe_report().encode()),
                                 "listing RAM steps saved on another layout")
    reports = decode_reports([r.report for r in records])
    foreign = [c for c in elastic_plan.candidates(reports)
               if c.count != self.count][:_MAX_CANDIDATES]
    if not foreign:
      return []
    covered = self._agree_coverage(foreign, set())
    return sorted({c.step for c, ok in zip(foreign, covered, strict=True) if ok})

  # --------------------------------------------------------------------- restore

  def restore(self, step: int | None, targets: dict[str, Any], single: bool | None,
              reports: list[HostReport], min_step: int | None,
              finish: Callable[[int, str], None]) -> ElasticResult:
    """Restores the newest save the cluster can assemble on the targets' layout.

    Collective: every process calls it with the same arguments (reports agreed).

    Raises:
      local_format.AbstractStateMismatchError: the targets do not match what was saved.
    """
    excluded: set[tuple[int, int, int]] = set()
    tried = False
    while True:
      candidates = elastic_plan.candidates(reports, requested_step=step, min_step=min_step,
                                           excluded=excluded)[:_MAX_CANDIDATES]
      if not candidates:
        return ElasticResult(False, None, None, tried)
      covered = self._agree_coverage(candidates, excluded)
      chosen = next((c for c, ok in zip(candidates, covered, strict=True) if ok), None)
      if chosen is None:
        return ElasticResult(False, None, None, True)
      tried = True
      plan = elastic_plan.ElasticPlan(chosen.step, chosen.count, chosen.digest,
                                      elastic_plan.choose_servers(chosen))
      _refuse_process_items(targets, plan, self.count)  # the same answer on every process
      value, bad = self._execute(plan, chosen, targets, single)
      if bad:
        excluded |= bad
        continue
      restored, default_item, json_items, complete = value
      finish(plan.step, TIER)
      if complete:
        self._write_back(plan.step, restored, default_item, json_items)
      else:
        # A write-back of some items would drop the others (rule 10): the step stays in the
        # old layout, which the next elastic restore reads again.
        logging.info("orbax-mtc: step %d restored without all its items; its folders keep "
                     "the layout it was saved with", plan.step)
      if single or (single is None and default_item):
        return ElasticResult(True, restored[item_args.DEFAULT_ITEM], plan.step, False)
      return ElasticResult(True, ocp.args.Composite(**restored), plan.step, False)

  def _my_folder_dir(self, kind: int, rank: int, step: int, digest_value: int) -> Path:
    if kind == OWN:
      return self._own_folder(step, rank, digest_value)
    return self._copy_dir(rank, step)

  def _layout_of(self, candidate: elastic_plan.Candidate,
                 excluded: set[tuple[int, int, int]]) -> StepManifest | None:
    """A manifest of `candidate` this node holds, or None."""
    for rank, holders in sorted(candidate.holders.items()):
      for process, kind in holders:
        if process == self._me and (process, rank, candidate.step) not in excluded:
          try:
            return local_store.read_manifest(
                self._my_folder_dir(kind, rank, candidate.step, candidate.digest))
          except local_format.LocalTierError:
            continue
    return None

  def _agree_coverage(self, candidates: list[elastic_plan.Candidate],
                      excluded: set[tuple[int, int, int]]) -> list[bool]:
    known = covered = 0
    for i, candidate in enumerate(candidates):
      manifest = self._layout_of(candidate, excluded)
      if manifest is None or digest(manifest) != candidate.digest:
        continue
      known |= 1 << i
      if elastic_plan.covered(holder_sets(manifest), candidate.available):
        covered |= 1 << i
    records = self._ledger.agree(CoverRecord(known=known, covered=covered),
                                 "planning an elastic restore")
    out = []
    for i in range(len(candidates)):
      knowers = [r for r in records if r.known >> i & 1]
      out.append(bool(knowers) and all(r.covered >> i & 1 for r in knowers))
    return out

  # --------------------------------------------------------------------- one attempt

  def _load(self, plan: elastic_plan.ElasticPlan
            ) -> tuple[dict[int, elastic_tiles.Folder], list[int], str, str]:
    """The folders this process serves, every checksum verified; (folders, damaged ranks,
    their messages, an error that proves no damage)."""
    folders: dict[int, elastic_tiles.Folder] = {}
    failed: list[int] = []
    problems: list[str] = []
    fatal: list[str] = []
    for rank, kind in sorted(plan.served_by(self._me).items()):
      try:
        if kind == OWN:
          folder = self._own_folder(plan.step, rank, plan.digest)
          manifest = local_store.read_manifest(folder)
          crcs: dict[tuple[int, int], int] = {}
          data = local_read.read_data(folder, manifest, crcs)
          local_read.verify_buffer(data, manifest, str(folder), crcs)
        else:
          folder = self._copy_dir(rank, plan.step)
          manifest, data = self._store.read(rank, plan.step,
                                            self._own_folder(plan.step, None, plan.digest))
        if (manifest.process_count, manifest.process_index) != (plan.count, rank) or \
            digest(manifest) != plan.digest:
          raise local_format.ManifestError(f"{folder}: not saved rank {rank} of this save")
        folders[rank] = elastic_tiles.Folder(manifest, data, str(folder))
      except Exception as e:  # noqa: BLE001 - agreed below, never raised here
        where = f"saved rank {rank} ({'own' if kind == OWN else 'copy'}): {type(e).__name__}: {e}"
        if isinstance(e, local_format.LocalTierError):  # damage: another source serves it
          failed.append(rank)
          problems.append(where)
        else:
          fatal.append(where)
    return folders, failed, "; ".join(problems), "; ".join(fatal)

  def _execute(self, plan: elastic_plan.ElasticPlan, candidate: elastic_plan.Candidate,
               targets: dict[str, Any], single: bool | None
               ) -> tuple[Any, set[tuple[int, int, int]]]:
    me, step = self._me, plan.step
    folders, failed, message, fatal = self._load(plan)
    layout = next(iter(folders.values())).manifest if folders else None
    outgoing: dict[int, peer_stream.OutgoingStream] = {}
    problem = ""
    if not failed and not fatal:
      try:
        outgoing = elastic_tiles.streams(me, self.count, plan, folders, layout, targets, single)
      except local_format.AbstractStateMismatchError as e:
        problem = str(e)
      except Exception as e:  # noqa: BLE001 - agreed below, raised on every process
        fatal = f"{type(e).__name__}: {e}"
    edges = [(src, dst) for src in range(self.count) for dst in range(self.count)
             if src != dst]
    sizes = exchange.outgoing_sizes(edges, me, outgoing)
    status = (Status.FAILED if fatal else Status.UNUSABLE if failed else
              Status.MISMATCH if problem else Status.OK)
    served = ServeRecord(status=status, failed_ranks=tuple(failed),
                         message=fatal or problem or message)
    buffers: dict[int, np.ndarray] = {}

    def sink_for(stream):
      buffer = buffers.setdefault(stream.source, local_read.aligned_empty(stream.nbytes))

      def sink(offset: int, data: np.ndarray) -> None:
        buffer[offset:offset + data.nbytes] = data
      return sink

    result = exchange.exchange(
        edges, me, outgoing, sizes, served,
        lambda row: self._ledger.allgather(row, f"serving step {step} elastically"),
        proceed=lambda records, _: all(r.status == Status.OK for r in records),
        sink_for=sink_for, chunk_limit=self._chunk_bytes, window=self._window)
    if result.transfer is None:
      records = result.records
      self._raise_mismatch([(p, r.message) for p, r in enumerate(records)
                            if r.status == Status.MISMATCH], step)
      _raise_failed({p: r.message for p, r in enumerate(records) if r.status == Status.FAILED},
                    step)
      bad = {(p, rank, step) for p, r in enumerate(records) for rank in r.failed_ranks}
      for p, r in enumerate(records):
        if r.status != Status.OK:
          logging.warning("orbax-mtc: process %d cannot serve step %d: %s", p, step, r.message)
      return None, bad
    result.transfer.run()
    try:
      if layout is None:
        layout = elastic_tiles.received_manifest(buffers)
      built = Built(Status.OK, elastic_tiles.build(me, plan, folders, buffers, layout, targets, single))
    except local_format.AbstractStateMismatchError as e:
      built = Built(Status.MISMATCH, message=str(e))
    except elastic_tiles.BadTile as e:
      built = Built(Status.UNUSABLE, message=str(e), bad=(e.process, e.rank))
    except local_format.LocalTierError as e:  # damage: another source or an older step
      built = Built(Status.UNUSABLE, message=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - not proof of damage: raised on every process
      logging.exception("orbax-mtc: error rebuilding step %d", step)
      built = Built(Status.FAILED, message=f"{type(e).__name__}: {e}")
    outcomes = self._ledger.agree(
        BuildRecord(status=built.status, bad_process=built.bad[0], bad_rank=built.bad[1],
                    message=built.message), f"rebuilding step {step} elastically")
    if all(o.status == Status.OK for o in outcomes):
      return built.value, set()
    self._raise_mismatch([(p, o.message) for p, o in enumerate(outcomes)
                          if o.status == Status.MISMATCH], step)
    _raise_failed({p: o.message for p, o in enumerate(outcomes) if o.status == Status.FAILED},
                  step)
    logging.warning("orbax-mtc: step %d could not be rebuilt on the new layout (%s); trying "
                    "other copies, an older step or the persistent tier.", step,
                    "; ".join(f"process {p}: {o.message}" for p, o in enumerate(outcomes)
                              if o.status != Status.OK))
    bad = {(o.bad_process, o.bad_rank, step) for o in outcomes if o.bad_process >= 0}
    if not bad:  # no culprit named: every folder of this save is out
      bad = {(p, rank, step) for rank, holders in candidate.holders.items() for p, _ in holders}
    return None, bad

  @staticmethod
  def _raise_mismatch(mismatched: list[tuple[int, str]], step: int) -> None:
    if mismatched:
      raise local_format.agreed_mismatch(*mismatched[0], step)

  # --------------------------------------------------------------------- the streams

  # --------------------------------------------------------------------- write-back

  def _write_back(self, step: int, restored: dict[str, Any], default_item: bool,
                  json_names: set[str]) -> None:
    """The step, as restored, into this node's own folder in the new layout, and peer copies
    sent again. Nothing of the old layout goes first (rule 10): its own folder is set aside
    at the new one's commit and kept while the step is; its copies are replaced by the new
    ones, or dropped once the new layout's first copies are out (`PeerCopies`)."""
    pytree_items = {k: v for k, v in restored.items() if k not in json_names}
    json_items = {k: v for k, v in restored.items() if k in json_names}
    staged = local_staging.stage(step, pytree_items, json_items, default_item=default_item)
    self._writer.drain()
    self._writer.write(staged, background=True, replace=aside.REPLACED)
    if self._peers.topology is not None:
      self._peers.schedule(step, pytree_items)


def _raise_failed(failed: dict[int, str], step: int) -> None:
  """An error that proves nothing about the bytes is raised on every process alike; no
  source is excluded for it, so no step is rolled back or dropped (rule 10)."""
  if failed:
    raise agreement.CheckpointError(f"rebuilding step {step} from RAM", failed)


def _refuse_process_items(targets: dict[str, Any], plan: elastic_plan.ElasticPlan,
                         count: int) -> None:
  """Per-process state (a data iterator's position) belongs to the process that saved it:
  an elastic restore has no such state for the new layout's processes."""
  names = sorted(item_args.process_targets(targets))
  if not names:
    return
  saved = f"{plan.count} processes" if plan.count != count else "another mesh"
  raise local_format.AbstractStateMismatchError(
      f"Step {plan.step} can only be restored here by rebuilding it from RAM on a new layout "
      f"(saved by {saved}; this job has {count} processes), and item(s) {names} hold "
      "per-process state (a data iterator's position), which belongs to the process that saved "
      "it. Restore without these items (leave them out of the restore args) and position the "
      f"iterators yourself, or restart with the layout that saved step {plan.step}.")


@dataclasses.dataclass(frozen=True)
class Built:
  status: Status
  value: Any = None
  message: str = ""
  bad: tuple[int, int] = (-1, -1)
