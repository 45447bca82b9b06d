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
5. after success every process writes the step back into its own folder in the new layout,
   and its peer copies are sent again, so the next save is an ordinary one.

Whole saved tiles travel (not sub-ranges): the receiver then checks each against the checksum
written at save time, end to end, at the cost of extra bytes where a new shard needs part of
a saved one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from orbax_mtc import agreement, elastic_plan, item_args
from orbax_mtc.agreement import Status
from orbax_mtc.elastic_plan import OWN, Box, FolderRef, HostReport
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import aside, checksum
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local import store as local_store
from orbax_mtc.local.format import LeafRecord, StepManifest
from orbax_mtc.local.specs import normalize_index, whole_index
from orbax_mtc.peers import exchange
from orbax_mtc.peers import store as peer_store
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.peers.copies import PeerCopies
from orbax_mtc.ram_writer import RamWriter

TIER = "elastic"  # RestoreInfo.tier of a step rebuilt on another layout
_MAX_CANDIDATES = 62  # candidates whose coverage one agreement decides (bits of an int64)

# ----------------------------------------------------------------------------- layout


def leaf_tiles(leaf: LeafRecord, count: int) -> tuple[tuple[Box, tuple[int, ...]], ...] | None:
  """A leaf's tiles and their holders; a host value is one whole tile every rank holds."""
  if leaf.kind == "host":
    return ((whole_index(leaf.shape), tuple(range(count))),)
  return leaf.tiles


def digest(manifest: StepManifest) -> int | None:
  """32-bit digest of a step's global layout (the process count, and per leaf its spec and
  tiles); None when an array leaf was saved without tiles (no elastic restore)."""
  parts: list[Any] = [manifest.process_count, manifest.default_item]
  for name in sorted(manifest.items):
    item = manifest.items[name]
    parts.append([name, item.kind])
    if item.kind == "process":
      continue  # each rank's own value: its size differs between ranks of one save
    for leaf in item.leaves:
      tiles = leaf_tiles(leaf, manifest.process_count)
      if tiles is None:
        return None
      parts.append([leaf.path, leaf.kind, list(leaf.shape), leaf.dtype, leaf.key_impl,
                    leaf.python_type, [[list(map(list, i)), list(h)] for i, h in tiles]])
  return google_crc32c.value(json.dumps(parts, separators=(",", ":")).encode())


def holder_sets(manifest: StepManifest) -> set[tuple[int, ...]]:
  """The distinct holder sets of a step's tiles (see `elastic_plan.holder_sets`)."""
  layouts = []
  for item in manifest.items.values():
    if item.kind == "process":
      continue  # held by its rank alone, and never rebuilt on another layout
    for leaf in item.leaves:
      tiles = leaf_tiles(leaf, manifest.process_count)
      if tiles is not None:
        layouts.append(tiles)
  return elastic_plan.holder_sets(layouts)


def target_boxes(key_dims: tuple[int, ...], shape: tuple[int, ...], sharding: Any,
                 process: int | None) -> list[tuple[Any, Box]]:
  """(device, global box of its shard) of a target leaf, for one process or (None) all;
  a target without sharding (a host value) is the whole array, device None."""
  if sharding is None:
    return [(None, whole_index(shape) + whole_index(key_dims))]
  out = []
  for device, index in sharding.devices_indices_map(shape).items():
    if process is None or device.process_index == process:
      out.append((device, normalize_index(index, shape) + whole_index(key_dims)))
  return out


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


class _BadTile(local_format.CorruptStepError):
  def __init__(self, message: str, process: int, rank: int):
    super().__init__(message)
    self.process, self.rank = process, rank


@dataclasses.dataclass
class _Folder:
  """A saved rank's folder this process serves: its manifest and verified bytes."""

  manifest: StepManifest
  data: np.ndarray
  where: str


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
            ) -> tuple[dict[int, _Folder], list[int], str, str]:
    """The folders this process serves, every checksum verified; (folders, damaged ranks,
    their messages, an error that proves no damage)."""
    folders: dict[int, _Folder] = {}
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
        folders[rank] = _Folder(manifest, data, str(folder))
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
        outgoing = self._streams(plan, folders, layout, targets, single)
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
        layout = self._received_manifest(buffers)
      built = Built(Status.OK, self._build(plan, folders, buffers, layout, targets, single))
    except local_format.AbstractStateMismatchError as e:
      built = Built(Status.MISMATCH, message=str(e))
    except _BadTile as e:
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

  def _target_leaves(self, layout: StepManifest, targets: dict[str, Any], single: bool | None
                     ) -> list[tuple[str, str, LeafRecord, Any, tuple, Any, tuple]]:
    """(item, path, saved leaf, target leaf, shape, sharding, key dims) of every target
    leaf, checked against the saved tree; AbstractStateMismatchError if it does not match."""
    if single is None:
      targets = item_args.as_saved(targets, layout.default_item)
    out = []
    for item_name, target in targets.items():
      record = layout.items.get(item_name)
      if record is None:
        raise local_format.MissingItemError(
            f"Item {item_name!r} is not in step {layout.step} (it holds {sorted(layout.items)}).",
            item_name)
      if record.kind == "json":
        continue
      by_path = {leaf.path: leaf for leaf in record.leaves}
      flat = jax.tree_util.tree_flatten_with_path(target)[0]
      paths = [jax.tree_util.keystr(p) for p, _ in flat]
      if sorted(paths) != sorted(by_path):
        raise local_format.AbstractStateMismatchError(
            f"Item {item_name!r}: the target tree does not match the saved tree. Leaves only "
            f"in the target: {sorted(set(paths) - set(by_path))[:5]}; leaves only in the "
            f"checkpoint: {sorted(set(by_path) - set(paths))[:5]}.")
      for (_, leaf), path in zip(flat, paths, strict=True):
        rec = by_path[path]
        shape, dtype, sharding = local_read.target_spec(leaf, rec)
        key_dims = local_read.check_leaf(item_name, path, rec, shape, dtype)
        out.append((item_name, path, rec, leaf, shape, sharding, key_dims))
    return out

  def _streams(self, plan: elastic_plan.ElasticPlan, folders: dict[int, _Folder],
               layout: StepManifest | None, targets: dict[str, Any], single: bool | None
               ) -> dict[int, peer_stream.OutgoingStream]:
    """What this process sends each other process: the tiles it provides to their shards
    (and, to a process serving nothing, the step's manifest)."""
    if layout is None:
      return {}
    me = self._me
    servers = plan.server_of()
    available = set(servers)
    served = {p: set(plan.served_by(p)) for p in range(self.count)}
    lowest = plan.servers[0][1]  # the process serving the lowest rank: sends the manifest
    sends: dict[int, dict[tuple, tuple[int, local_format.ShardRecord]]] = {}
    for item_name, path, rec, _, shape, sharding, key_dims in self._target_leaves(
        layout, targets, single):
      tiles = leaf_tiles(rec, plan.count) or ()
      boxes = elastic_plan.TileIndex(index for index, _ in tiles)  # many targets
      wanted: dict[int, list[Box]] = {}  # process -> boxes of its new shards
      if sharding is None:  # a host value: every process gets the whole array
        wanted = {p: [box] for p in range(self.count)
                  for _, box in target_boxes(key_dims, shape, None, None)}
      else:
        for device, box in target_boxes(key_dims, shape, sharding, None):
          wanted.setdefault(device.process_index, []).append(box)
      for dest in range(self.count):
        if dest == me:
          continue
        for box in dict.fromkeys(wanted.get(dest, ())):
          for i, _ in elastic_plan.pieces(box, boxes):
            index, holders = tiles[i]
            rank = elastic_plan.provider(holders, served[dest], available, dest)
            if rank is None or servers[rank] != me:
              continue
            key = (item_name, path, index)
            if key not in sends.setdefault(dest, {}):
              shard = self._shard(folders[rank].manifest, item_name, path, index)
              sends[dest][key] = (rank, shard)
    out: dict[int, peer_stream.OutgoingStream] = {}
    for dest in range(self.count):
      needs_manifest = me == lowest and not served[dest]
      tiles_out = sends.get(dest, {})
      if dest == me or not (tiles_out or needs_manifest):
        continue
      entries, pieces, offset = [], [], 0
      for (item_name, path, index), (rank, shard) in tiles_out.items():
        entries.append([item_name, path, [list(d) for d in index], rank, offset, shard.nbytes,
                        shard.crc32c])
        pieces.append((offset, rank, shard))
        offset = -(-(offset + shard.nbytes) // 64) * 64
      header = {"kind": "tiles", "step": plan.step, "tiles": entries,
                "manifest": layout.to_json() if needs_manifest else None}
      framed, data_start = peer_stream.stream_header(header)
      segments = [peer_stream.Segment(0, framed.nbytes, buffer=framed)]
      for rel, rank, shard in pieces:
        data = folders[rank].data
        segments.append(peer_stream.Segment(data_start + rel, shard.nbytes,
                                            buffer=data[shard.offset:shard.offset + shard.nbytes]))
      out[dest] = peer_stream.OutgoingStream(nbytes=data_start + offset, segments=segments)
    return out

  @staticmethod
  def _shard(manifest: StepManifest, item: str, path: str, index: Box) -> local_format.ShardRecord:
    leaf = next(x for x in manifest.items[item].leaves if x.path == path)
    return next(s for s in leaf.shards if s.index == index)

  @staticmethod
  def _received_manifest(buffers: dict[int, np.ndarray]) -> StepManifest:
    for buffer in buffers.values():
      header, _ = peer_stream.parse_stream_header(buffer)
      if header.get("manifest"):
        return StepManifest.from_json(peer_stream.header_text(header, "manifest"),
                                      where="manifest of an elastic restore stream")
    raise local_format.CorruptStepError("no process sent the step's manifest")

  # --------------------------------------------------------------------- building

  def _build(self, plan: elastic_plan.ElasticPlan, folders: dict[int, _Folder],
             buffers: dict[int, np.ndarray], layout: StepManifest, targets: dict[str, Any],
             single: bool | None) -> tuple[dict[str, Any], bool, set[str]]:
    # (item, path) -> {tile index: uint8 bytes}: the tiles of the folders served here...
    have: dict[tuple[str, str], dict[Box, np.ndarray]] = {}
    for folder in folders.values():
      for item_name, leaf, shard in local_read.manifest_entries(folder.manifest):
        have.setdefault((item_name, leaf.path), {}).setdefault(
            shard.index, folder.data[shard.offset:shard.offset + shard.nbytes])
    # ... and those received, each checked against the checksum written at save time.
    for source, buffer in sorted(buffers.items()):
      header, data_start = peer_stream.parse_stream_header(buffer)
      for entry in header.get("tiles") or []:
        item_name, path, index, rank, offset, nbytes, crc = entry
        raw = buffer[data_start + offset:data_start + offset + nbytes]
        if raw.nbytes != nbytes or checksum.crc(raw) != crc:
          raise _BadTile(f"tile {item_name}{path} {index} of saved rank {rank} from process "
                         f"{source}: checksum mismatch", source, rank)
        have.setdefault((item_name, path), {})[tuple(tuple(d) for d in index)] = raw
    if single is None:
      targets = item_args.as_saved(targets, layout.default_item)
    leaves_by_item: dict[str, list[Any]] = {}
    for item_name, path, rec, leaf, shape, sharding, key_dims in self._target_leaves(
        layout, targets, single):
      tiles = have.get((item_name, path), {})
      dtype = local_format.np_dtype(rec.dtype)
      boxes = list(tiles)
      shards = []
      for device, box in target_boxes(key_dims, shape, sharding, self._me):
        dims = [hi - lo for lo, hi in box]
        try:
          parts = elastic_plan.pieces(box, boxes)
        except ValueError as e:
          raise local_format.CorruptStepError(f"leaf {item_name}{path}: {e}") from e
        if len(parts) == 1 and boxes[parts[0][0]] == box:
          # The saved tile is the new shard: its (aligned, verified) bytes, no copy.
          shards.append((device, tiles[box].view(dtype).reshape(dims)))
          continue
        # Aligned, so that JAX's CPU client adopts the buffer instead of copying it.
        out = local_read.aligned_empty(
            max(1, int(np.prod(dims, dtype=np.int64))) * dtype.itemsize)
        out = out[:int(np.prod(dims, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(dims)
        for i, part in parts:
          index = boxes[i]
          tile = tiles[index].view(dtype).reshape([hi - lo for lo, hi in index])
          out[elastic_plan.relative(part, box)] = tile[elastic_plan.relative(part, index)]
        shards.append((device, out))
      leaves_by_item.setdefault(item_name, []).append(
          _as_leaf(rec, leaf, shape, sharding, shards))
    restored: dict[str, Any] = {}
    for item_name, target in targets.items():
      record = layout.items[item_name]
      if record.kind == "json":
        restored[item_name] = record.value
        continue
      treedef = jax.tree_util.tree_structure(target)
      restored[item_name] = jax.tree_util.tree_unflatten(treedef, leaves_by_item[item_name])
    json_items = {name for name in restored if layout.items[name].kind == "json"}
    # Per-process items never move to another layout; every other item must be here.
    complete = {name for name, item in layout.items.items() if item.kind != "process"
                } <= set(restored)
    return restored, layout.default_item, json_items, complete

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


def _as_leaf(rec: LeafRecord, target_leaf: Any, shape: tuple, sharding: Any,
             shards: list[tuple[Any, np.ndarray]]) -> Any:
  """The restored leaf from its per-device host shards."""
  if sharding is None:
    value = shards[0][1]
    if rec.key_impl is not None:
      return jax.random.wrap_key_data(value, impl=rec.key_impl)
    if rec.python_type is not None and not isinstance(target_leaf, (np.ndarray, jax.Array)):
      return {"int": int, "float": float, "bool": bool}[rec.python_type](value)
    return value
  if rec.key_impl is not None:
    arrays = [jax.random.wrap_key_data(jax.device_put(x, d), impl=rec.key_impl)
              for d, x in shards]
  else:
    arrays = [jax.device_put(x, d) for d, x in shards]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
