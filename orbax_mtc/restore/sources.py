"""The restore sources one host holds, behind one small interface: its own step folders
(`OwnFolder`, current or set aside by a write-back) and the peer copies it keeps for other
nodes (`PeerCopy`). The third source, bytes received from another process, is the stream
`tiles.build` reads. A new kind of source is a new class with `manifest`, `read` and `locate`.

`HostFolders.report()` names every folder by (step, process count, saved rank, layout
digest): the host's part of the restore's one agreement. A folder's identity is the saved
rank its manifest names, never the process holding it (rule 11): process ids may be permuted
at a restart, and a copy serves its source's rank wherever it lies. File I/O only, no
collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
from absl import logging

from orbax_mtc import agreement
from orbax_mtc.local import aside
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import store as local_store
from orbax_mtc.local.format import StepManifest
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.restore.plan import ASIDE, COPY, OWN, FolderRef, HostReport
from orbax_mtc.restore.tiles import Folder, Located, digest


@dataclasses.dataclass(frozen=True)
class OwnFolder:
  """A step folder of this host's RAM tier: `<local>/<step>` or one a write-back set aside."""

  path: Path
  primary: bool  # the current `<local>/<step>`
  known: StepManifest  # as checked when the host's report was made (this restore)

  def manifest(self) -> StepManifest:
    return self.known

  def read(self) -> tuple[StepManifest, np.ndarray]:
    manifest = self.known
    crcs: dict[tuple[int, int], int] = {}
    data = local_read.read_data(self.path, manifest, crcs)
    local_read.verify_buffer(data, manifest, str(self.path), crcs)
    return manifest, data

  def locate(self) -> dict[int, tuple[Path, int]]:
    data = self.path / local_format.DATA
    return {shard.offset: (data, shard.offset)
            for _, _, shard in local_read.manifest_entries(self.known)}


@dataclasses.dataclass(frozen=True)
class PeerCopy:
  """A copy of another node's step held here; shards it shares with an own folder of the
  same save are read from that folder (`peers.copy_store`)."""

  store: peer_store.PeerStore
  source: int
  step: int
  own: Path  # the own folder of the same save
  known: StepManifest  # as checked when the host's report was made (this restore)
  primary = False

  @property
  def path(self) -> Path:
    return self.store.source_dir(self.source) / str(self.step)

  def manifest(self) -> StepManifest:
    return self.known

  def read(self) -> tuple[StepManifest, np.ndarray]:
    return self.store.read(self.source, self.step, self.own)

  def locate(self) -> dict[int, tuple[Path, int]]:
    manifest, places = self.store.locate(self.source, self.step, self.own)
    if manifest != self.known:
      raise local_format.ManifestError(f"{self.path}: the copy changed during the restore")
    return {place.shard.offset: (place.path, place.offset) for place in places}


Source = OwnFolder | PeerCopy


class HostFolders:
  """The folders this host can serve, and reading them back.

  Args:
    local: this node's RAM tier.
    store: the peer copies this node holds.
    count: processes in the job now.
    use_copies: whether copies of this process count serve (this job replicates: with
      replication off, a copy left by an earlier run may be of a step number this run saved
      anew, so only copies saved by another process count are used then).
  """

  def __init__(self, local: local_store.LocalTier, store: peer_store.PeerStore, count: int,
               use_copies: Callable[[], bool]):
    self._local, self._store = local, store
    self._count, self._use_copies = count, use_copies
    self._sources: dict[tuple[int, FolderRef], Source] = {}  # of the last report

  def report(self) -> HostReport:
    """The folders this host can serve, named by saved rank, count and layout digest.

    Reads only manifests; a folder that cannot be read, or was saved without a layout, is
    left out. Own folders include the layouts a write-back set aside (`local.aside`): until
    the step is retired they still serve it.
    """
    sources: dict[tuple[int, FolderRef], Source] = {}
    own_of: dict[tuple[int, int], Path] = {}  # (step, digest) -> an own folder of that save
    root = self._local.directory
    folders = [(step, root / str(step), True) for step in self._local.steps()]
    folders += [(step, path, False) for step, path in aside.replaced_folders(root)]
    seen: set[FolderRef] = set()
    for step, path, primary in folders:
      ref, manifest = _ref(path, step, None)
      if ref is not None and ref not in seen:
        seen.add(ref)
        sources[(OWN if primary else ASIDE, ref)] = OwnFolder(path, primary, manifest)
        own_of.setdefault((ref.step, ref.digest), path)
    use_copies = self._use_copies()
    for source, step in self._store.copies():
      ref, manifest = _ref(self._store.source_dir(source) / str(step), step, source)
      if ref is None or (ref.count == self._count and not use_copies):
        continue
      try:
        # Its shards marked "in my own folder" need an own folder of the same save.
        needs_own = self._store.meta(source, step).needs_own_step
      except local_format.LocalTierError:
        continue
      own = own_of.get((step, ref.digest))
      if needs_own and own is None:
        continue
      sources[(COPY, ref)] = PeerCopy(self._store, source, step, own or root / str(step),
                                      manifest)
    self._sources = sources
    by_kind: dict[int, list[FolderRef]] = {OWN: [], COPY: [], ASIDE: []}
    for kind, ref in sources:
      by_kind[kind].append(ref)
    report = HostReport(own=tuple(by_kind[OWN]), copies=tuple(by_kind[COPY]),
                        aside=tuple(by_kind[ASIDE]))
    # At most agreement.ELASTIC_REPORT_BYTES, the slot reports had when they were gathered
    # (the plan keeps its answer): the oldest steps go first.
    while len(report.encode()) > agreement.ELASTIC_REPORT_BYTES:
      oldest = min(ref.step for _, refs in report.kinds() for ref in refs)
      report = HostReport(*(tuple(r for r in refs if r.step != oldest)
                            for _, refs in report.kinds()))
    return report

  def safe_report(self) -> HostReport:
    """`report`, or an empty one when this host's folders cannot be listed."""
    try:
      return self.report()
    except Exception:  # noqa: BLE001 - an unreadable folder only loses restore choices
      logging.exception("orbax-mtc: cannot list this node's folders for a restore")
      return HostReport()

  def _source(self, kind: int, rank: int, step: int, count: int, digest_value: int) -> Source:
    source = self._sources.get((kind, FolderRef(step, count, rank, digest_value)))
    if source is None:
      raise local_format.LocalTierError(
          f"step {step}: no {('own', 'copy', 'set-aside')[kind]} folder of saved rank {rank} "
          "here any more")
    return source

  def manifest(self, kind: int, rank: int, step: int, count: int,
               digest_value: int) -> StepManifest:
    """The manifest of one folder of the last report (LocalTierError if unusable)."""
    return self._source(kind, rank, step, count, digest_value).manifest()

  def load(self, kind: int, rank: int, step: int, count: int, digest_value: int) -> Folder:
    """One folder of saved rank `rank` of the save (step, count, digest), read back with
    every checksum verified.

    Raises:
      LocalTierError: the folder is damaged or not of that save (proof of damage).
      OSError, ...: anything else (no proof of damage).
    """
    source = self._source(kind, rank, step, count, digest_value)
    manifest, data = source.read()
    _check_identity(source, manifest, rank, count, digest_value)
    return Folder(manifest, data, str(source.path), primary=source.primary)


  def locate(self, kind: int, rank: int, step: int, count: int, digest_value: int) -> Located:
    """One folder of saved rank `rank` of the save, its shards' places in files (nothing
    read or verified: for sending, the receiver checks). Raises as `load`."""
    source = self._source(kind, rank, step, count, digest_value)
    manifest = source.manifest()
    _check_identity(source, manifest, rank, count, digest_value)
    return Located(manifest, str(source.path), source.locate())


def _check_identity(source: Source, manifest: StepManifest, rank: int, count: int,
                    digest_value: int) -> None:
  """ManifestError unless `manifest` is saved rank `rank` of the save (count, digest)."""
  if (manifest.process_count, manifest.process_index) != (count, rank) or \
      digest(manifest) != digest_value:
    raise local_format.ManifestError(f"{source.path}: not saved rank {rank} of this save")


def _ref(folder: Path, step: int, source: int | None
         ) -> tuple[FolderRef | None, StepManifest | None]:
  """The folder's name in a report, and its checked manifest (None, None: not servable)."""
  try:
    manifest = local_store.read_manifest(folder, process_index=source)
  except local_format.LocalTierError:
    return None, None
  value = digest(manifest)
  if value is None or manifest.step != step:
    return None, None
  return FolderRef(step, manifest.process_count, manifest.process_index, value), manifest
