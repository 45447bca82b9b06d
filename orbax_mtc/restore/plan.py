"""Pure planning of a RAM restore, on the saved layout or any other (mesh, process count,
device count, rank order): the saved layout is the plan in which nothing moves.

A step saved by C processes is C folders, one per saved rank, each holding that rank's shards
("tiles") and, in its manifest, the step's global layout: per leaf, every tile and the saved
ranks holding it. At a restart, a folder of saved rank r may sit in any process's own RAM
folder (permuted process ids), in a folder a write-back set aside, or in a peer copy; a tile
may be held by several ranks (data-parallel replicas). This module decides, without I/O or
JAX:

* what each process reports (`HostReport`, a compact byte string: a few dozen bytes per
  folder it holds, well under 1 KiB for a host);
* which step is restored: the newest whose folders, from one save (same process count and
  layout digest), cover every tile (`plan`), or None;
* which process serves each saved rank's folder (own folder first, then the least loaded copy
  holder), so the plan is O(saved ranks), not O(shards);
* per target shard, which tiles give its bytes (`boxes.pieces`) and which saved rank provides a
  tile the receiver lacks (`provider`): every process computes the same answer, so senders
  and receivers agree without another message.

A plan never mixes steps or saves: every folder it uses has the chosen step, process count
and layout digest.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
from collections.abc import Callable, Collection, Iterable, Sequence

# Box geometry lives in `boxes`; re-exported here for callers of `elastic_plan.pieces` etc.
from orbax_mtc.restore.boxes import Box as Box
from orbax_mtc.restore.boxes import TileIndex as TileIndex
from orbax_mtc.restore.boxes import intersect as intersect
from orbax_mtc.restore.boxes import pieces as pieces
from orbax_mtc.restore.boxes import relative as relative
from orbax_mtc.restore.boxes import volume as volume

# Where a host holds a folder: its own RAM folder, a peer copy, or an own folder of an older
# layout that a write-back set aside (`local.aside`), which still serves while kept.
OWN, COPY, ASIDE = 0, 1, 2
_KIND_NAMES = {OWN: "own", COPY: "copy", ASIDE: "aside"}


# ----------------------------------------------------------------------------- reports


@dataclasses.dataclass(frozen=True, order=True)
class FolderRef:
  """A saved rank's folder of one step, as a host holds it.

  Attributes:
    step: The step.
    count: The process count the step was saved with.
    rank: The saved rank whose shards the folder holds.
    digest: 32-bit digest of the step's global layout (equal: same layout; see
      `restore.tiles.digest`).
  """

  step: int
  count: int
  rank: int
  digest: int


@dataclasses.dataclass(frozen=True)
class HostReport:
  """What one host can serve for a restore: its own folders, those set aside, its copies.

  Attributes:
    own: Folders in the host's own RAM folder.
    copies: Peer copies the host holds (complete, servable).
    aside: Own folders of an older layout a write-back set aside (still servable).
  """

  own: tuple[FolderRef, ...] = ()
  copies: tuple[FolderRef, ...] = ()
  aside: tuple[FolderRef, ...] = ()

  def kinds(self) -> tuple[tuple[int, tuple[FolderRef, ...]], ...]:
    return ((OWN, self.own), (COPY, self.copies), (ASIDE, self.aside))

  def encode(self) -> bytes:
    """The report as compact bytes: per (kind, step, count, digest) group, the ranks as
    varint deltas. A host with a few steps and a peer copy of each takes ~50 bytes."""
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for kind, refs in self.kinds():
      for ref in refs:
        groups.setdefault((kind, ref.step, ref.count, ref.digest), []).append(ref.rank)
    out = bytearray()
    _put(out, len(groups))
    for (kind, step, count, digest), ranks in sorted(groups.items()):
      _put(out, kind)
      _put(out, step)
      _put(out, count)
      out += int(digest & 0xFFFFFFFF).to_bytes(4, "little")
      ranks = sorted(set(ranks))
      _put(out, len(ranks))
      previous = 0
      for rank in ranks:
        _put(out, rank - previous)
        previous = rank
    return bytes(out)

  @classmethod
  def decode(cls, data: bytes) -> HostReport:
    """Reads `encode`'s bytes back.

    Raises:
      ValueError: the bytes are not a report.
    """
    pos = 0

    def get() -> int:
      nonlocal pos
      value, shift = 0, 0
      while True:
        if pos >= len(data) or shift > 63:
          raise ValueError("truncated or malformed elastic host report")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
          return value
        shift += 7

    own: list[FolderRef] = []
    copies: list[FolderRef] = []
    aside: list[FolderRef] = []
    for _ in range(get()):
      kind, step, count = get(), get(), get()
      if kind not in _KIND_NAMES or pos + 4 > len(data):
        raise ValueError("malformed elastic host report")
      digest = int.from_bytes(data[pos:pos + 4], "little")
      pos += 4
      rank = 0
      for _ in range(get()):
        rank += get()
        {OWN: own, COPY: copies, ASIDE: aside}[kind].append(FolderRef(step, count, rank, digest))
    if pos != len(data):
      raise ValueError("trailing bytes after an elastic host report")
    return cls(own=tuple(own), copies=tuple(copies), aside=tuple(aside))


@contextlib.contextmanager
def paused_gc():
  """Python's cyclic collector paused: decoding and planning allocate a few objects per folder
  and no cycles, and at 10,000 hosts the collector's passes over them (and over the layout's
  tiles held meanwhile) would double the time."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def decode_reports(raws: Sequence[bytes], on_error: Callable[[int, ValueError], None] | None
                   = None) -> list[HostReport]:
  """Every process's report, decoded; an unreadable one counts as holding nothing (and is
  passed to `on_error` with its process index)."""
  out = []
  with paused_gc():
    for process, raw in enumerate(raws):
      try:
        out.append(HostReport.decode(raw))
      except ValueError as e:
        if on_error is not None:
          on_error(process, e)
        out.append(HostReport())
  return out


def _put(out: bytearray, value: int) -> None:
  if value < 0:
    raise ValueError(f"a report holds non-negative numbers only, got {value}")
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return


# ----------------------------------------------------------------------------- the plan

Save = tuple[int, int, int]  # (step, count, digest): one save of one step


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One save of one step and where each of its saved ranks' folders is held.

  Attributes:
    step: The step.
    count: The process count it was saved with.
    digest: Its layout digest.
    holders: Per saved rank held anywhere, the (process, OWN or COPY) pairs holding it.
  """

  step: int
  count: int
  digest: int
  holders: dict[int, tuple[tuple[int, int], ...]]

  @property
  def available(self) -> frozenset[int]:
    """The saved ranks some process can serve."""
    return frozenset(self.holders)


@dataclasses.dataclass(frozen=True)
class ElasticPlan:
  """The save to restore and who serves each of its available saved ranks.

  Attributes:
    step: The step.
    count: The process count it was saved with.
    digest: Its layout digest.
    servers: (saved rank, serving process, OWN or COPY), ascending by rank, one per saved
      rank some process holds.
  """

  step: int
  count: int
  digest: int
  servers: tuple[tuple[int, int, int], ...]

  def server_of(self) -> dict[int, int]:
    """Saved rank -> the process serving its folder."""
    return {rank: process for rank, process, _ in self.servers}

  def served_by(self, process: int) -> dict[int, int]:
    """Saved rank -> OWN or COPY, for the folders `process` serves."""
    return {rank: kind for rank, p, kind in self.servers if p == process}


def wanted(ref: FolderRef, requested_step: int | None, min_step: int | None) -> bool:
  """Whether a reported folder can be a candidate's: of the step asked for, not older than
  `min_step`, and of a saved rank within its save's count (`candidates`; restore/census
  filters each process's own folders with the same rule)."""
  return ((requested_step is None or ref.step == requested_step)
          and (min_step is None or ref.step >= min_step) and 0 <= ref.rank < ref.count)


def candidates(reports: Sequence[HostReport], *, requested_step: int | None = None,
               min_step: int | None = None,
               excluded: Collection[tuple[int, int, int]] = ()) -> list[Candidate]:
  """Every save some host holds a folder of, newest step first.

  Args:
    reports: Per current process, its report.
    requested_step: Only this step, or None for any.
    min_step: Only steps at or above it (the newest persistent step: older RAM steps lose
      work), or None.
    excluded: (process, saved rank, step) folders that failed: never used again.

  Returns:
    The candidates, newest step first; for one step, the save held by most ranks first.
  """
  bad = set(excluded)
  saves: dict[Save, dict[int, list[tuple[int, int]]]] = {}
  for process, report in enumerate(reports):
    for kind, refs in report.kinds():
      for ref in refs:
        if not wanted(ref, requested_step, min_step) or (process, ref.rank, ref.step) in bad:
          continue
        ranks = saves.setdefault((ref.step, ref.count, ref.digest), {})
        ranks.setdefault(ref.rank, []).append((process, kind))
  out = [Candidate(step, count, digest, {r: tuple(sorted(h, key=lambda x: (x[1], x[0])))
                                         for r, h in ranks.items()})
         for (step, count, digest), ranks in saves.items()]
  # For one step: the save most ranks can serve, then the one held most in current folders
  # (a layout written back is preferred to the one it replaced).
  out.sort(key=lambda c: (-c.step, -len(c.holders), -_current(c), c.count, c.digest))
  return out


def _current(candidate: Candidate) -> int:
  """Saved ranks held in some host's current own folder."""
  return sum(any(kind == OWN for _, kind in holders) for holders in candidate.holders.values())


def choose_servers(candidate: Candidate) -> tuple[tuple[int, int, int], ...]:
  """One serving process per available saved rank.

  A rank's own folder wins (a current one over one set aside), then copies (no second read
  path); among copies, the holder with
  the fewest folders already assigned, then the lowest process, so copies spread the load.

  Args:
    candidate: The save.

  Returns:
    (saved rank, process, OWN or COPY), ascending by rank.
  """
  load: dict[int, int] = {}
  servers: list[tuple[int, int, int]] = []
  copy_only: list[int] = []
  for rank in sorted(candidate.holders):
    for own_kind in (OWN, ASIDE):
      own = [p for p, kind in candidate.holders[rank] if kind == own_kind]
      if own:
        process = min(own, key=lambda p: (load.get(p, 0), p))
        load[process] = load.get(process, 0) + 1
        servers.append((rank, process, own_kind))
        break
    else:
      copy_only.append(rank)
  for rank in copy_only:
    process = min((p for p, _ in candidate.holders[rank]), key=lambda p: (load.get(p, 0), p))
    load[process] = load.get(process, 0) + 1
    servers.append((rank, process, COPY))
  return tuple(sorted(servers))


def plan(reports: Sequence[HostReport], covers: Callable[[Candidate], bool], *,
         requested_step: int | None = None, min_step: int | None = None,
         excluded: Collection[tuple[int, int, int]] = ()) -> ElasticPlan | None:
  """The newest save whose available folders cover every tile, and its servers.

  Args:
    reports: Per current process, its report.
    covers: Whether a candidate's available ranks hold every tile of its layout (from the
      layout: `covered`; in a live job, agreed among the processes that read the layout).
    requested_step: Only this step, or None for the newest.
    min_step: Only steps at or above it, or None.
    excluded: (process, saved rank, step) folders that failed.

  Returns:
    The plan, or None when no save can be assembled.
  """
  with paused_gc():
    for candidate in candidates(reports, requested_step=requested_step, min_step=min_step,
                                excluded=excluded):
      if covers(candidate):
        return ElasticPlan(candidate.step, candidate.count, candidate.digest,
                           choose_servers(candidate))
  return None


# ----------------------------------------------------------------------------- tiles


def holder_sets(layouts: Iterable[Sequence[tuple[Box, Sequence[int]]]]) -> set[tuple[int, ...]]:
  """The distinct sets of saved ranks holding a tile, over leaves' layouts.

  A save is covered when every one of these sets meets the available ranks; there are far
  fewer of them than tiles (typically one per replica group), so coverage is cheap to test.

  Args:
    layouts: Per leaf, its (tile, holder ranks) pairs.
  """
  return {tuple(sorted(holders)) for layout in layouts for _, holders in layout}


def covered(sets: Iterable[Sequence[int]], available: Collection[int]) -> bool:
  """Whether every holder set has an available rank."""
  return all(any(rank in available for rank in holders) for holders in sets)


def provider(holders: Sequence[int], receiver_ranks: Collection[int],
             available: Collection[int], receiver: int,
             preferred: Collection[int] = ()) -> int | None:
  """The saved rank whose folder gives a tile to `receiver`.

  Args:
    holders: The saved ranks holding the tile, ascending (as manifests list them).
    receiver_ranks: The saved ranks the receiver serves itself.
    available: The saved ranks some process serves.
    receiver: The receiving process (spreads receivers over a tile's replicas).
    preferred: Saved ranks to take first when they hold the tile (those served from an own
      folder: a copy then need not be read).

  Returns:
    None when the receiver serves a holder itself (no transfer); else the chosen rank.

  Raises:
    ValueError: no holder is available (the plan was not covered).
  """
  if len(receiver_ranks) < len(holders):
    # A replicated tile lists every saved rank: look the receiver's few ranks up instead.
    if any(_has(holders, rank) for rank in receiver_ranks):
      return None
  elif any(rank in receiver_ranks for rank in holders):
    return None
  ready = [rank for rank in holders if rank in available]
  if not ready:
    raise ValueError(f"no available saved rank holds a tile (holders {sorted(holders)})")
  best = [rank for rank in ready if rank in preferred] or ready
  return best[receiver % len(best)]


def holds(holders: Sequence[int], rank: int) -> bool:
  """Whether `rank` is among a tile's holders (ascending, as manifests list them)."""
  return _has(holders, rank)


def _has(ascending: Sequence[int], value: int) -> bool:
  i = bisect.bisect_left(ascending, value)
  return i < len(ascending) and ascending[i] == value
