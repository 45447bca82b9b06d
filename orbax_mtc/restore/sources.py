"""The restore sources one host holds: its own step folders (and the older layouts a
write-back set aside) and the peer copies it keeps for other nodes, behind one small
interface.

`HostFolders.report()` names every folder by (step, process count, saved rank, layout
digest): the host's part of the restore's one agreement. `load` reads one of them back with
every checksum verified. A folder's identity is the saved rank its manifest names, never the
process holding it (rule 11): process ids may be permuted at a restart, and a copy serves its
source's rank wherever it lies. File I/O only, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from absl import logging

from orbax_mtc import agreement
from orbax_mtc.local import aside
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import store as local_store
from orbax_mtc.local.format import StepManifest
from orbax_mtc.peers import store as peer_store
from orbax_mtc.restore.plan import COPY, OWN, FolderRef, HostReport
from orbax_mtc.restore.tiles import Folder, digest


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
    self._own: dict[FolderRef, Path] = {}  # of the last report

  def own_dir(self, step: int) -> Path:
    return self._local.directory / str(step)

  def _own_folder(self, step: int, rank: int | None, digest_value: int) -> Path:
    """The own folder (current or set aside) of a step's save with this layout digest,
    saved by `rank` (None: any rank)."""
    for ref, folder in self._own.items():
      if (ref.step, ref.digest) == (step, digest_value) and rank in (None, ref.rank):
        return folder
    return self.own_dir(step)

  def report(self) -> HostReport:
    """The folders this host can serve, named by saved rank, count and layout digest.

    Reads only manifests; a folder that cannot be read, or was saved without a layout, is
    left out. Own folders include the layouts a write-back set aside (`local.aside`): until
    the step is retired they still serve it.
    """
    own: list[FolderRef] = []
    set_aside: list[FolderRef] = []
    self._own = {}
    folders = [(step, self.own_dir(step)) for step in self._local.steps()]
    folders += aside.replaced_folders(self._local.directory)
    for step, folder in folders:
      ref = _ref(folder, step, None)
      if ref is not None and ref not in self._own:
        (own if folder == self.own_dir(step) else set_aside).append(ref)
        self._own[ref] = folder
    held = {(ref.step, ref.digest) for ref in own + set_aside}
    copies: list[FolderRef] = []
    use_copies = self._use_copies()
    for source, step in self._store.copies():
      ref = _ref(self._store.source_dir(source) / str(step), step, source)
      if ref is None or (ref.count == self._count and not use_copies):
        continue
      try:
        # Its shards marked "in my own folder" need an own folder of the same save.
        if self._store.meta(source, step).needs_own_step and (step, ref.digest) not in held:
          continue
      except local_format.LocalTierError:
        continue
      copies.append(ref)
    report = HostReport(own=tuple(own), copies=tuple(copies), aside=tuple(set_aside))
    # The agreement has room for agreement.ELASTIC_REPORT_BYTES: drop the oldest steps first.
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

  def manifest(self, kind: int, rank: int, step: int, digest_value: int) -> StepManifest:
    """The manifest of one folder this host holds (LocalTierError if unusable)."""
    if kind != COPY:
      return local_store.read_manifest(self._own_folder(step, rank, digest_value))
    return local_store.read_manifest(self._store.source_dir(rank) / str(step))

  def load(self, kind: int, rank: int, step: int, count: int, digest_value: int) -> Folder:
    """One folder of saved rank `rank` of the save (step, count, digest), read back with
    every checksum verified.

    Raises:
      LocalTierError: the folder is damaged or not of that save (proof of damage).
      OSError, ...: anything else (no proof of damage).
    """
    if kind != COPY:
      folder = self._own_folder(step, rank, digest_value)
      manifest = local_store.read_manifest(folder)
      crcs: dict[tuple[int, int], int] = {}
      data = local_read.read_data(folder, manifest, crcs)
      local_read.verify_buffer(data, manifest, str(folder), crcs)
    else:
      folder = self._store.source_dir(rank) / str(step)
      manifest, data = self._store.read(rank, step, self._own_folder(step, None, digest_value))
    if (manifest.process_count, manifest.process_index) != (count, rank) or \
        digest(manifest) != digest_value:
      raise local_format.ManifestError(f"{folder}: not saved rank {rank} of this save")
    return Folder(manifest, data, str(folder), primary=kind == OWN and folder == self.own_dir(step))


def _ref(folder: Path, step: int, source: int | None) -> FolderRef | None:
  try:
    manifest = local_store.read_manifest(folder, process_index=source)
  except local_format.LocalTierError:
    return None
  value = digest(manifest)
  if value is None or manifest.step != step:
    return None
  return FolderRef(step, manifest.process_count, manifest.process_index, value)
