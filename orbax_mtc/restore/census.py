"""The restore agreement's planning as reductions (pure): which saves exist, which saved ranks
each can serve, and who serves them.

An all-gather of every host's folder report (restore/plan.HostReport) hands each process one
slot per process (1 KiB: 100 MiB at 100,000 hosts). Here each process adds fixed-size vectors
(reduction.Parts), and the answer is the one `plan.candidates` + `plan.choose_servers` give
from the gathered reports (tests/test_restore_census.py):

* **saves** (once per plan): every save (step, process count, layout digest) some process
  holds a folder of, in hashed buckets as the minimum and maximum of its fields; a bucket
  whose minimum equals its maximum names one save, and a bucket that does not is hashed again
  into more buckets (16 int32 x 10 per bucket);
* **tiers** (per step, newest first, until a save is chosen): per (save of the step, saved
  rank), the best kind of folder any process holds, a uint8 max of 2 x kind (3 own, 2 set
  aside, 1 copy, 0 none) + 1 where the holder is the process of that index (a restart on the
  saved layout): availability, the candidates' order and each rank's preferred kind;
* **cover** (per step, unless the newest save is whole): per save, how many processes read its
  layout and how many of those find it not covered (the old `CoverRecord`), and per kind how
  many (process, rank) holdings are at their rank's best kind;
* **servers** (the chosen save): where every rank's best kind has one holder (the counts
  say), that holder: the process of the rank's index when the tiers round says so, else its
  process + 1 in `width` bytes, one uint8 max each (only that process adds them);
  where some have several, the lowest holder (an int32 max of -process) and then the next
  ones, one round each, so the load-spreading choice of `plan.choose_servers` is replayed
  exactly.

No I/O and no JAX: the collective is passed in (restore/executor.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

import numpy as np

from orbax_mtc import reduction
from orbax_mtc.reduction import LOW, Parts
from orbax_mtc.restore.plan import ASIDE, COPY, OWN, HostReport, wanted

Save = tuple[int, int, int]  # (step, count, digest)
Mine = dict[Save, dict[int, tuple[int, ...]]]  # save -> saved rank -> kinds held (ascending)
Reduce = Callable[[reduction.Round], Parts]

TIER = {OWN: 3, ASIDE: 2, COPY: 1}  # the order choose_servers prefers them in
KIND = {3: OWN, 2: ASIDE, 1: COPY}
FIRST_BUCKETS = 16
MAX_BUCKETS = 4096
MAX_SAVE_ROUNDS = 8
MAX_COUNT = 1 << 24  # a save of more saved ranks is no candidate (reports hold no such)
TIERS_ROUND_BYTES = 256 << 10  # a listing's tiers round: about 0.5 MiB received, ring all-reduce
_FIELDS = 5  # step (two halves), count, digest (two 16-bit halves)


def holdings(report: HostReport, me: int, *, requested_step: int | None = None,
             min_step: int | None = None, excluded: Collection[tuple[int, int, int]] = (),
             dropped: Collection[Save] = ()) -> Mine:
  """This process's usable folders, as `plan.candidates` filters them; a save in `dropped`
  (every folder of it failed) also takes out this process's folders of its (rank, step)."""
  gone = {(ref.rank, ref.step) for _, refs in report.kinds() for ref in refs
          if (ref.step, ref.count, ref.digest) in dropped}
  out: dict[Save, dict[int, set[int]]] = {}
  for kind, refs in report.kinds():
    for ref in refs:
      if not wanted(ref, requested_step, min_step) or ref.count > MAX_COUNT:
        continue
      if (me, ref.rank, ref.step) in excluded or (ref.rank, ref.step) in gone:
        continue
      out.setdefault((ref.step, ref.count, ref.digest), {}).setdefault(ref.rank, set()).add(kind)
  return {s: {r: tuple(sorted(k)) for r, k in ranks.items()} for s, ranks in out.items()}


# ----------------------------------------------------------------------------- saves


@dataclasses.dataclass(frozen=True)
class SavesShape:
  """A saves round's buckets and hash."""

  buckets: int = FIRST_BUCKETS
  salt: int = 0

  def bucket(self, save: Save) -> int:
    mixed = hash_save(save) * 0x9E3779B97F4A7C15 + (self.salt + 1) * 0x632BE59BD9B4E019
    return ((mixed % 2 ** 64) >> 32) % self.buckets


def hash_save(save: Save) -> int:
  step, count, digest = save
  return (step * 1_000_003 + count) * 4_294_967_311 + digest + 1


def _fields(save: Save) -> list[int]:
  step, count, digest = save
  return [*reduction.split(step), count, digest >> 16, digest & 0xFFFF]


def saves_parts(mine: Collection[Save], shape: SavesShape) -> Parts:
  """Per bucket, the fields' maxima and negated minima over this process's saves."""
  parts = Parts.empty(0, 2 * _FIELDS * shape.buckets)
  for save in mine:
    at = 2 * _FIELDS * shape.bucket(save)
    fields = np.asarray(_fields(save), np.int32)
    parts.top[at:at + _FIELDS] = np.maximum(parts.top[at:at + _FIELDS], fields)
    parts.top[at + _FIELDS:at + 2 * _FIELDS] = np.maximum(
        parts.top[at + _FIELDS:at + 2 * _FIELDS], -fields)
  return parts


def read_saves(reduced: Parts, shape: SavesShape) -> tuple[list[Save], bool]:
  """The saves the buckets name, and whether every non-empty bucket named one."""
  found, whole = [], True
  for b in range(shape.buckets):
    cell = reduced.top[2 * _FIELDS * b:2 * _FIELDS * (b + 1)].astype(np.int64)
    high, neg_low = cell[:_FIELDS], cell[_FIELDS:]
    if high[0] == LOW:
      continue
    if not (high == -neg_low).all():
      whole = False
      continue
    h, lo, count, d_high, d_low = (int(v) for v in high)
    found.append((reduction.join(h, lo), count, (d_high << 16) | d_low))
  return found, whole


def agree_saves(mine: Mine, me: int, reduce: Reduce, rounds: list[Parts]) -> list[Save]:
  """Every save some process holds, newest step first, then (count, digest)."""
  shape = SavesShape()
  for _ in range(MAX_SAVE_ROUNDS):
    reduced = reduce(reduction.Round(mine, me, lambda m, _, s=shape: saves_parts(m, s)))
    rounds.append(reduced)
    found, whole = read_saves(reduced, shape)
    if whole:
      return sorted(found, key=lambda s: (-s[0], s[1], s[2]))
    shape = SavesShape(min(4 * shape.buckets, MAX_BUCKETS), shape.salt + 1)
  raise RuntimeError(f"orbax-mtc: the saves held could not be named in {MAX_SAVE_ROUNDS} "
                     f"rounds (more than {MAX_BUCKETS} buckets can tell apart)")


# ----------------------------------------------------------------------------- tiers


@dataclasses.dataclass(frozen=True, eq=False)  # numpy fields: compared by identity
class Agreed:
  """One save as the reductions describe it (the same on every process).

  Attributes:
    step, count, digest: The save.
    tiers: Per saved rank, the best kind any process holds (3 own, 2 aside, 1 copy, 0 none).
    selfheld: Per saved rank, whether the process of its index holds it at that kind.
  """

  step: int
  count: int
  digest: int
  tiers: np.ndarray
  selfheld: np.ndarray

  @property
  def save(self) -> Save:
    return (self.step, self.count, self.digest)

  @property
  def available(self) -> frozenset[int]:
    """The saved ranks some process can serve."""
    return frozenset(int(r) for r in np.flatnonzero(self.tiers))

  @property
  def held(self) -> int:
    return int(np.count_nonzero(self.tiers))

  @property
  def current(self) -> int:
    """Saved ranks held in some host's current own folder."""
    return int(np.count_nonzero(self.tiers == TIER[OWN]))

  def order(self) -> tuple[int, int, int, int, int]:
    """`plan.candidates`'s order."""
    return (-self.step, -self.held, -self.current, self.count, self.digest)


def tiers_parts(mine: Mine, me: int, saves: Sequence[Save]) -> Parts:
  """Per (save, saved rank), 2 x the best kind this process holds, + 1 if it is rank `me`."""
  parts = Parts.empty(0, 0, sum(s[1] for s in saves))
  at = 0
  for save in saves:
    for rank, kinds in mine.get(save, {}).items():
      parts.flags[at + rank] = 2 * max(TIER[k] for k in kinds) + (rank == me)
    at += save[1]
  return parts


def tiers_batches(saves: Sequence[Save], budget: int = TIERS_ROUND_BYTES
                  ) -> list[tuple[Save, ...]]:
  """`saves` in order, cut so that each tiers round's vector (a byte per saved rank) stays
  within `budget` bytes, or holds one save where a single save is larger: a listing that
  examines many saves at once then receives no more per round at 100,000 hosts."""
  batches: list[tuple[Save, ...]] = []
  batch: list[Save] = []
  size = 0  # bytes of `batch`'s vector
  for save in saves:
    if batch and size + save[1] > budget:
      batches.append(tuple(batch))
      batch, size = [], 0
    batch.append(save)
    size += save[1]
  return [*batches, tuple(batch)] if batch else batches


def read_tiers(reduced: Parts, saves: Sequence[Save]) -> list[Agreed]:
  """The saves with their agreed tiers, in `plan.candidates`'s order."""
  out, at = [], 0
  for step, count, digest in saves:
    cell = reduced.flags[at:at + count]
    out.append(Agreed(step, count, digest, cell >> 1, (cell & 1).astype(bool)))
    at += count
  return sorted(out, key=Agreed.order)


def cover_parts(mine: Mine, saves: Sequence[Agreed], known: Sequence[bool],
                covered: Sequence[bool]) -> Parts:
  """Per save: whether this process read its layout, found it not covered, and its
  holdings at their rank's best kind, per kind (own, aside, copy)."""
  parts = Parts.empty(5 * len(saves), 0)
  for i, agreed in enumerate(saves):
    parts.add[5 * i] = int(known[i])
    parts.add[5 * i + 1] = int(known[i] and not covered[i])
    for rank, kinds in mine.get(agreed.save, {}).items():
      best = int(agreed.tiers[rank])
      if best and KIND[best] in kinds:
        parts.add[5 * i + 2 + (3 - best)] += 1
  return parts


@dataclasses.dataclass(frozen=True)
class Cover:
  """A cover round's answer for one save.

  Attributes:
    covered: Some process read its layout and every such process found it covered.
    holders: Per best kind (own, aside, copy), the holdings at that kind.
  """

  covered: bool
  holders: tuple[int, int, int]


def read_cover(reduced: Parts, count: int) -> list[Cover]:
  add = reduced.add.astype(np.int64)
  return [Cover(bool(add[5 * i] > 0 and add[5 * i + 1] == 0),
                tuple(int(v) for v in add[5 * i + 2:5 * i + 5]))  # type: ignore[arg-type]
          for i in range(count)]


# ----------------------------------------------------------------------------- choosing

Facts = Callable[[int, Sequence[Agreed]], tuple[Sequence[bool], Sequence[bool]]]


def choose(mine: Mine, me: int, reduce: Reduce, facts: Facts, *,
           usable: Callable[[Agreed], bool] = lambda a: True,
           refuse: Callable[[Agreed], None] = lambda a: None, limit: int = 62,
           rounds: list[Parts] | None = None
           ) -> tuple[Agreed | None, Cover | None, list[tuple[Agreed, bool]]]:
  """The save to restore: the newest covered and `usable` one, in `plan.candidates`'s order.

  Steps are examined newest first, a tiers and a cover round each, until one has a usable
  save; every branch reads only reduced data (rule 8).

  Args:
    mine: This process's usable folders (`holdings`).
    me: This process.
    reduce: The collective.
    facts: `facts(process, saves)`: whether that process read each save's layout, and found
      it covered (a live job calls it for itself only; a simulation for every process).
    usable: Whether a covered save may be chosen (per-process items need every rank).
    refuse: Called with the newest covered save when its step has none usable (it may raise).
    limit: Saves examined at most.
    rounds: Where the reduced rounds are appended.

  Returns:
    (the chosen save, its cover answer, every save examined with whether it is covered).
  """
  rounds = [] if rounds is None else rounds

  def run(contribute: Callable[[Mine, int], Parts]) -> Parts:
    rounds.append(reduce(reduction.Round(mine, me, contribute)))
    return rounds[-1]

  saves = agree_saves(mine, me, reduce, rounds)[:limit]
  newest: Agreed | None = None
  examined: list[tuple[Agreed, bool]] = []
  for step in sorted({s[0] for s in saves}, reverse=True):
    group = tuple(s for s in saves if s[0] == step)
    agreed = read_tiers(run(lambda m, p, g=group: tiers_parts(m, p, g)), group)
    first = agreed[0]
    # Every saved rank of the newest save is available: it covers itself and is the one
    # chosen, so no process reads a layout (the usual restart); the cover round then only
    # counts the holders, for the servers round.
    fast = not examined and first.held == first.count and usable(first)

    def cover(m: Mine, p: int, agreed: list[Agreed] = agreed, fast: bool = fast) -> Parts:
      known, found = ([False] * len(agreed),) * 2 if fast else facts(p, agreed)
      return cover_parts(m, agreed, known, found)
    covers = read_cover(run(cover), len(agreed))
    covered = [(a.held == a.count) if fast else c.covered
               for c, a in zip(covers, agreed, strict=True)]
    examined += zip(agreed, covered, strict=True)
    if newest is None and any(covered):
      newest = agreed[covered.index(True)]
    for i, ok in enumerate(covered):
      if ok and usable(agreed[i]):
        return agreed[i], covers[i], examined
    if newest is not None:
      refuse(newest)
  return None, None, examined


# ----------------------------------------------------------------------------- servers


def width(processes: int) -> int:
  """Bytes of a process index + 1."""
  return max(1, -(-processes.bit_length() // 8))


def unique_tiers(agreed: Agreed, holders: Sequence[int]) -> set[int]:
  """The best kinds whose ranks each have one holder there (the holdings equal the ranks)."""
  return {t for t in (3, 2, 1)
          if holders[3 - t] == int(np.count_nonzero(agreed.tiers == t))}


def servers_parts(mine: Mine, me: int, agreed: Agreed, coded: Sequence[int],
                  shared: Sequence[int], processes: int) -> Parts:
  """For the `coded` ranks (one holder at the best kind, not the rank's own process), the
  holder's process + 1 in `width` uint8 maxima; for the `shared` ranks (several holders),
  -process maxed (the lowest)."""
  w = width(processes)
  parts = Parts.empty(0, len(shared), w * len(coded))
  codes = {rank: i for i, rank in enumerate(coded)}
  slot = {rank: i for i, rank in enumerate(shared)}
  code = np.frombuffer((me + 1).to_bytes(w, "little"), np.uint8)
  for rank, kinds in mine.get(agreed.save, {}).items():
    best = int(agreed.tiers[rank])
    if not best or KIND[best] not in kinds:
      continue
    if rank in codes:
      parts.flags[w * codes[rank]:w * codes[rank] + w] = code
    elif rank in slot:
      parts.top[slot[rank]] = -me
  return parts


def next_parts(mine: Mine, me: int, agreed: Agreed, shared: Sequence[int],
               last: Sequence[int]) -> Parts:
  """For each shared rank, -process if this process holds it at its best kind and comes
  after the holder found last (-1: none more to find)."""
  parts = Parts.empty(0, len(shared))
  ranks = mine.get(agreed.save, {})
  for i, rank in enumerate(shared):
    best = int(agreed.tiers[rank])
    if last[i] >= 0 and me > last[i] and KIND[best] in ranks.get(rank, ()):
      parts.top[i] = -me
  return parts


def agree_servers(mine: Mine, me: int, agreed: Agreed, cover: Cover, processes: int,
                  reduce: Reduce, rounds: list[Parts]) -> tuple[tuple[int, int, int], ...]:
  """`plan.choose_servers` of the chosen save: (saved rank, process, kind), by rank."""
  unique = unique_tiers(agreed, cover.holders)
  held = [int(r) for r in np.flatnonzero(agreed.tiers)]
  shared = [r for r in held if int(agreed.tiers[r]) not in unique]
  coded = [r for r in held if int(agreed.tiers[r]) in unique and not agreed.selfheld[r]]
  reduced = reduce(reduction.Round(mine, me, lambda m, p: servers_parts(
      m, p, agreed, coded, shared, processes)))
  rounds.append(reduced)
  w = width(processes)
  holders: dict[int, list[int]] = {r: [r] for r in held
                                   if int(agreed.tiers[r]) in unique and agreed.selfheld[r]}
  codes = reduced.flags.reshape(len(coded), w)
  for i, rank in enumerate(coded):
    holders[rank] = [int.from_bytes(codes[i].tobytes(), "little") - 1]
  last = [int(-v) for v in reduced.top]
  for i, rank in enumerate(shared):
    holders[rank] = [last[i]]
  while shared:
    reduced = reduce(reduction.Round(mine, me, lambda m, p, f=tuple(last): next_parts(
        m, p, agreed, shared, f)))
    rounds.append(reduced)
    last = [int(-v) if v != LOW else -1 for v in reduced.top]
    for i, rank in enumerate(shared):
      if last[i] >= 0:
        holders[rank].append(last[i])
    if all(v < 0 for v in last):
      break
  return replay(agreed, holders)


def replay(agreed: Agreed, holders: dict[int, list[int]]) -> tuple[tuple[int, int, int], ...]:
  """`plan.choose_servers` from each rank's holders at its best kind: own folders (current,
  then set aside) by rank, then copies, each to the least loaded holder, then the lowest."""
  load: dict[int, int] = {}
  servers: list[tuple[int, int, int]] = []

  def pick(rank: int) -> None:
    process = min(holders[rank], key=lambda p: (load.get(p, 0), p))
    load[process] = load.get(process, 0) + 1
    servers.append((rank, process, KIND[int(agreed.tiers[rank])]))

  ranks = sorted(holders)
  for rank in ranks:
    if int(agreed.tiers[rank]) != TIER[COPY]:
      pick(rank)
  for rank in ranks:
    if int(agreed.tiers[rank]) == TIER[COPY]:
      pick(rank)
  return tuple(sorted(servers))


def planning_vectors(count: int, processes: int, coded: int, saves: int = 1,
                     shared: int = 0, shared_rounds: int = 0) -> list[int]:
  """Bytes of each round's vector planning a restore of a save of `count` saved ranks, the
  newest step holding `saves` saves of that size (no collision in the first saves round):
  saves, tiers, cover and servers, where `coded` ranks have one holder that is not the
  process of their index, and `shared` have several (`shared_rounds` more rounds)."""
  return [4 * 2 * _FIELDS * FIRST_BUCKETS, saves * count, 4 * 5 * saves,
          width(processes) * coded + 4 * shared] + [4 * shared] * shared_rounds


def planning_bytes(count: int, processes: int, coded: int, saves: int = 1, shared: int = 0,
                   shared_rounds: int = 0) -> int:
  """Bytes one process receives in those rounds (ring all-reduces)."""
  vectors = planning_vectors(count, processes, coded, saves, shared, shared_rounds)
  return sum(reduction.received_bytes(v, processes) for v in vectors)
