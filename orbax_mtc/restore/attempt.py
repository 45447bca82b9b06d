"""One attempt at a planned RAM restore: fetch, exchange, build, agreed outcome.

Each process reads the manifests of the folders it serves, computes the same routes as every
other process (`tiles.routes`), and then:

- when no process needs bytes from another (the saved layout, every folder in place), it
  reads and builds its own part at once, and the exchange's one agreement carries the
  outcome;
- else it reads the folders its own shards come from, sends the tiles others need from
  those, or straight from the files of folders it only serves to others, as the transfer
  goes (each receiver checks every tile against the checksum written at save time), and
  every process builds after the transfer and agrees on the outcome.

A failed attempt ends the same way on every process: `Exclude` (damaged sources, agreed:
plan again without them), `Lacking` (a per-process item missing from a folder), the caller's
mismatch, or `CheckpointError` for an error that proves no damage (rule 10: nothing is
excluded or deleted for it).
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Any

import numpy as np
from absl import logging

from orbax_mtc import agreement
from orbax_mtc.agreement import BuildRecord, Status
from orbax_mtc.ledger import StepLedger
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.peers import exchange
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.restore import outcome as agreed_outcome
from orbax_mtc.restore import plan as restore_plan
from orbax_mtc.restore import tiles
from orbax_mtc.restore.plan import OWN
from orbax_mtc.restore.sources import HostFolders

Sources = set[tuple[int, int, int]]  # (process, saved rank, step) folders
_KIND_NAMES = ("own", "copy", "set-aside")
# Errors opening or reading a folder's data file that prove the folder is not whole.
_DAMAGE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


class Exclude(Exception):
  """Damaged sources (agreed): plan again without them."""

  def __init__(self, sources: Sources):
    super().__init__(str(sorted(sources)))
    self.sources = sources


class Lacking(Exception):
  """Folders without a per-process item asked for (agreed): a twin-rebuilt folder has none,
  while a peer's copy of the node's own folder may still have it."""

  def __init__(self, error: local_format.MissingItemError, step: int, sources: Sources):
    super().__init__(str(error))
    self.error, self.step, self.sources = error, step, sources


@dataclasses.dataclass
class Attempted:
  """A successful attempt: this process's part, and every process's agreed outcome."""

  built: tiles.BuiltStep
  outcome: agreed_outcome.Outcome


class StepAttempt:
  """Runs attempts at restoring planned steps from the folders `folders` serves.

  Args:
    me: this process.
    count: processes in the job now.
    folders: the folders this host serves (its last report).
    ledger: the agreements.
    chunk_bytes: largest transfer chunk.
    window: transfer chunks in flight.
  """

  def __init__(self, *, me: int, count: int, folders: HostFolders, ledger: StepLedger,
               chunk_bytes: int, window: int):
    self._me, self._count = me, count
    self._folders, self._ledger = folders, ledger
    self._chunk_bytes, self._window = chunk_bytes, window

  def run(self, plan: restore_plan.ElasticPlan, targets: dict[str, Any], single: bool | None, per_process: list[str]) -> Attempted:
    """One attempt (collective). Raises `Exclude`, `Lacking`, the caller's mismatch or
    `CheckpointError`, the same on every process."""
    me, count, step = self._me, self._count, plan.step
    manifests, failed, problems = self._manifests(plan, per_process)
    layout = next(iter(manifests.values()), None)
    mismatch, routes = "", None
    if not failed:
      try:
        routes = tiles.routes(me, count, plan, manifests, layout, targets, single)
      except local_format.AbstractStateMismatchError as e:
        mismatch = str(e)
      except Exception as e:  # noqa: BLE001 - agreed below, raised on every process
        failed[Status.FAILED] = []
        problems.append(f"{type(e).__name__}: {e}")
    folders: dict[int, tiles.Folder] = {}
    outgoing: dict[int, peer_stream.OutgoingStream] = {}
    early, built = BuildRecord(status=Status.NONE), None
    if routes is not None and not failed:
      # Read before any collective: a process that dies reading leaves the others in an
      # agreement (bounded by its timeout), never inside a transfer.
      folders = self._gather(self.load, plan, routes.needed, failed, problems)
      if not failed and routes.exchange:
        located = self._gather(self.locate, plan, routes.sent - set(folders), failed, problems)
        if not failed:
          try:
            outgoing = tiles.streams(plan, routes, folders, located, layout)
          except Exception as e:  # noqa: BLE001 - agreed below (rule 9)
            failed[Status.FAILED] = []
            problems.append(f"{type(e).__name__}: {e}")
      elif not failed:
        # Nothing moves: build now, and let the exchange's one agreement carry the outcome
        # (the saved layout restores with two agreements in all).
        built, early = self._build(plan, folders, {}, layout, targets, single)
    status = next((s for s in (Status.FAILED, Status.UNUSABLE, Status.LACKING) if s in failed),
                  Status.MISMATCH if mismatch else Status.OK)
    served = agreement.ServeRecord(status=status, failed_ranks=tuple(failed.get(status, ())),
                                   message=mismatch or "; ".join(problems), early=early)
    # Reductions (restore/outcome, peers/exchange): their size grows with the streams that
    # move, never with the pairs of processes.
    what = f"serving step {step}"
    sends = {dest: stream.nbytes for dest, stream in outgoing.items()}
    agreed_serve = agreed_outcome.agree_serve(
        served, me, count, plan.server_of(), plan.count, sends,
        lambda rnd: self._ledger.reduce(rnd, what))
    if not agreed_serve.serving.ok:
      raise_agreed(agreed_serve.serving, step)
    if agreed_serve.early is not None:
      agreed = agreed_serve.early
    else:
      buffers, sink_for = receive_buffers()
      failures: list[str] = []
      if agreed_serve.streams:
        plan_of_streams = exchange.agree_streams(
            sends, me, count, agreed_serve.streams, agreed_serve.bits, agreed_serve.most,
            lambda rnd: self._ledger.reduce(rnd, what))
        transfer = exchange.transfer(
            plan_of_streams, me, outgoing, sink_for=sink_for, chunk_limit=self._chunk_bytes,
            window=self._window, reduce=lambda rnd: self._ledger.reduce(rnd, what))
        transfer.run()
        failures = transfer.failures
      if built is None:
        if layout is None:
          try:
            layout = tiles.received_manifest(buffers)
          except local_format.LocalTierError as e:
            early = BuildRecord(status=Status.UNUSABLE, message=str(e))
        if layout is not None:
          built, early = self._build(plan, folders, buffers, layout, targets, single)
      early = _moving_outcome(me, step, outgoing, failures) or early
      # Reductions (restore/outcome): their size does not grow with the cluster.
      agreed = agreed_outcome.agree(
          early, me, count, plan.server_of(), plan.count,
          lambda rnd: self._ledger.reduce(rnd, f"building step {step}"))
    if agreed.ok:
      assert built is not None
      return Attempted(built, agreed)
    raise_agreed(agreed, step)
    raise AssertionError("unreachable")

  # --------------------------------------------------------------------- fetching

  def _manifests(self, plan: restore_plan.ElasticPlan, per_process: list[str]
                 ) -> tuple[dict[int, local_format.StepManifest], dict[Status, list[int]],
                            list[str]]:
    """The manifests of the folders this process serves (failed ranks by status: UNUSABLE
    for damage, LACKING for a per-process item asked for and missing, FAILED otherwise)."""
    manifests: dict[int, local_format.StepManifest] = {}
    failed: dict[Status, list[int]] = {}
    problems: list[str] = []
    for rank, kind in sorted(plan.served_by(self._me).items()):
      where = f"saved rank {rank} ({_KIND_NAMES[kind]})"
      try:
        manifest = self._folders.manifest(kind, rank, plan.step, plan.count, plan.digest)
      except Exception as e:  # noqa: BLE001 - agreed, then excluded or raised everywhere
        damage = isinstance(e, local_format.LocalTierError)
        failed.setdefault(Status.UNUSABLE if damage else Status.FAILED, []).append(rank)
        problems.append(f"{where}: {type(e).__name__}: {e}")
        continue
      gone = [n for n in per_process
              if getattr(manifest.items.get(n), "kind", None) != "process"]
      if gone:
        failed.setdefault(Status.LACKING, []).append(rank)
        problems.append(f"Item {gone[0]!r} is not in {where} of step {plan.step}")
        continue
      manifests[rank] = manifest
    return manifests, failed, problems

  def load(self, plan: restore_plan.ElasticPlan, rank: int) -> tiles.Folder:
    """A served folder read back, every checksum verified."""
    return self._folders.load(plan.served_by(self._me)[rank], rank, plan.step, plan.count,
                              plan.digest)

  def locate(self, plan: restore_plan.ElasticPlan, rank: int) -> tiles.Located:
    """A served folder's shards in their files, for sending."""
    return self._folders.locate(plan.served_by(self._me)[rank], rank, plan.step, plan.count,
                                plan.digest)

  @staticmethod
  def _gather(fetch, plan: restore_plan.ElasticPlan, ranks: set[int],
              failed: dict[Status, list[int]], problems: list[str]) -> dict[int, Any]:
    """`fetch(plan, rank)` of each rank; failures added to `failed` (UNUSABLE for damage,
    FAILED otherwise) and `problems`."""
    out: dict[int, Any] = {}
    for rank in sorted(ranks):
      try:
        out[rank] = fetch(plan, rank)
      except Exception as e:  # noqa: BLE001 - agreed, then excluded or raised everywhere
        damage = isinstance(e, local_format.LocalTierError)
        failed.setdefault(Status.UNUSABLE if damage else Status.FAILED, []).append(rank)
        problems.append(f"saved rank {rank}: {type(e).__name__}: {e}")
    return out

  # --------------------------------------------------------------------- building

  def _build(self, plan: restore_plan.ElasticPlan, folders: dict[int, tiles.Folder],
             buffers: dict[int, np.ndarray], layout: local_format.StepManifest,
             targets: dict[str, Any], single: bool | None
             ) -> tuple[tiles.BuiltStep | None, BuildRecord]:
    """This process's part of the step, and the outcome it reports (never raises)."""
    me = self._me
    try:
      built = tiles.build(me, self._count, plan, folders, buffers, layout, targets, single)
    except local_format.AbstractStateMismatchError as e:
      return None, BuildRecord(status=Status.MISMATCH, message=str(e))
    except tiles.BadTile as e:
      return None, BuildRecord(status=Status.UNUSABLE, bad_process=e.process, bad_rank=e.rank,
                               message=str(e))
    except local_format.LocalTierError as e:  # damage: another source or an older step
      return None, BuildRecord(status=Status.UNUSABLE, message=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - not proof of damage: raised on every process
      logging.exception("orbax-mtc: error building step %d", plan.step)
      return None, BuildRecord(status=Status.FAILED, message=f"{type(e).__name__}: {e}")
    mine = folders.get(me)
    return built, BuildRecord(moved=built.moved, in_place=bool(
        mine is not None and mine.primary and plan.served_by(me).get(me) == OWN))


def _moving_outcome(me: int, step: int, outgoing: dict[int, peer_stream.OutgoingStream],
                    moved: list[str]) -> BuildRecord | None:
  """What this process reports when a tile it sent could not be read (it went as zeros, so
  its receiver rejects it too) or a chunk could not be placed or received (`moved`, the
  transfer's failures): the folder is damaged when its file is gone or short; any other
  error proves nothing and is raised everywhere."""
  if moved:
    message = f"moving step {step}: {moved[0]}"
    return BuildRecord(status=Status.FAILED, message=message)
  failures = [f for stream in outgoing.values() for f in stream.failures or ()]
  if not failures:
    return None
  rank, error = failures[0]
  message = (f"sending step {step} from saved rank {rank}: {type(error).__name__}: {error}")
  logging.warning("orbax-mtc: %s", message)
  if all(isinstance(e, local_format.LocalTierError) or
         (isinstance(e, OSError) and e.errno in _DAMAGE_ERRNOS) for _, e in failures):
    return BuildRecord(status=Status.UNUSABLE, bad_process=me, bad_rank=rank, message=message)
  return BuildRecord(status=Status.FAILED, message=message)


def raise_agreed(outcome: agreed_outcome.Outcome, step: int) -> None:
  """Ends a failed attempt the same way on every process (the outcome is agreed)."""
  if Status.MISMATCH in outcome.said:  # the caller's error, not a bad copy: nothing deleted
    raise local_format.agreed_mismatch(*outcome.said[Status.MISMATCH], step)
  if outcome.counts[Status.FAILED]:
    # An error that proves nothing about the bytes (a device out of memory, an I/O error):
    # excluding the source would roll back to an older step and drop this one (rule 10).
    what = f"restoring step {step} from RAM"
    if outcome.counts[Status.FAILED] > len(outcome.failed):
      what += f" ({outcome.counts[Status.FAILED]} processes; the lowest named)"
    raise agreement.CheckpointError(what, dict(outcome.failed))
  for status, (p, message) in outcome.said.items():
    logging.warning("orbax-mtc: step %d: process %d (and %d more): %s", step, p,
                    outcome.counts[status] - 1, message)
  if outcome.lacking:
    error = local_format.agreed_mismatch(*outcome.said[Status.LACKING], step)
    raise Lacking(error, step, {(p, rank, step) for p, rank in outcome.lacking})
  # Empty: no culprit named, every folder of this save is out.
  raise Exclude({(p, rank, step) for p, rank in outcome.bad})


def receive_buffers() -> tuple[dict[int, np.ndarray], Any]:
  """Sinks that collect whole streams into aligned buffers."""
  buffers: dict[int, np.ndarray] = {}

  def sink_for(stream):
    buffer = buffers.setdefault(stream.source, local_read.aligned_empty(stream.nbytes))

    def sink(offset: int, data: np.ndarray) -> None:
      buffer[offset:offset + data.nbytes] = data
    return sink
  return buffers, sink_for
