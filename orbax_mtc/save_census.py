"""The save agreement as reductions: what each process adds, and the answer that follows (pure).

Every local save agrees the step, the faults, the backup votes and the step lists (rule 8).
An all-gather of every process's `SaveRecord` made each process receive a row per process;
here each process adds fixed-size vectors (reduction.Parts), and the answer is read from
their sums and maxima, equal to what the rows would give (tests/test_save_census.py):

* census (every save): counts of the flags, the backup states and the faults; the lowest
  process of each; the range of the steps; process 0's clock (a one-hot slot); and, per
  *slot* (a step every process names alike: the agreed step lists and the step saved), how
  many nodes hold it in their own folder, see it persistent, have it as their newest own
  step or as the oldest of a cut persistent list, and how many peer copies of it exist.
  A step some node holds outside the slots is counted and put in a hashed bucket as its
  minimum and maximum (31-bit halves): a bucket whose minimum equals its maximum names the
  step exactly, and the census runs again with it in a slot (more buckets, another hash);
* coverage (only for a step some nodes lack in their own folder): one byte per node, the
  max (an OR) of "I can serve this node's data": its own folder, a twin's, a peer copy;
* names (only on an error): the steps' lowest and highest holders, and bitmaps of the
  processes with a fault (each sets only its own bit, so the sum is the OR);
* messages (only on a fault): the faults of the lowest few faulty processes, each in its own
  one-hot slot.

No I/O and no JAX: the collective is passed in (ledger.StepLedger.agree_save).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from orbax_mtc import agreement, reduction
from orbax_mtc.agreement import SaveRecord, Status
from orbax_mtc.reduction import LOW, Parts, Who

SEED_SLOTS = 64  # agreed steps given a slot before the first census
FIRST_BUCKETS = 16  # hashed buckets for steps outside the slots; x4 per further census
MAX_BUCKETS = 4096
MAX_CENSUSES = 16  # each names every step alone in its bucket: a few suffice
NAMED_FAULTS = 4  # faults whose messages travel; the others are counted
_FAULT_ROW = 2 * agreement.row_size(agreement.Fault)  # int32 values of one encoded Fault
_STATES = len(Status)


class _Cursor:
  """Hands out consecutive slices of one vector."""

  def __init__(self) -> None:
    self.size = 0

  def take(self, n: int) -> slice:
    self.size += n
    return slice(self.size - n, self.size)


@dataclasses.dataclass(frozen=True)
class CensusShape:
  """What every process must agree on before a census: its slots and buckets.

  Attributes:
    slots: The steps counted one by one.
    buckets: Hashed buckets for the steps outside `slots`.
    salt: The hash's salt (a different hash each census).
  """

  slots: tuple[int, ...]
  buckets: int = FIRST_BUCKETS
  salt: int = 0

  def bucket(self, step: int) -> int:
    # Python ints: a numpy integer overflows on the constants instead of wrapping.
    mixed = ((int(step) + 1) * 0x9E3779B97F4A7C15 + (int(self.salt) + 1) * 0x632BE59BD9B4E019
             ) % 2 ** 64
    return (mixed >> 32) % self.buckets


class _Layout:
  def __init__(self, shape: CensusShape):
    k, a, t = len(shape.slots), _Cursor(), _Cursor()
    self.local_faults, self.backup_faults, self.in_ram = a.take(1), a.take(1), a.take(1)
    self.in_persistent, self.wants_backup, self.busy, self.copies_failed = \
        (a.take(1) for _ in range(4))
    self.states, self.clock, self.no_own, self.unknown = a.take(_STATES), a.take(2), \
        a.take(1), a.take(1)
    self.own, self.persistent, self.newest, self.cut, self.copies = (a.take(k) for _ in
                                                                     range(5))
    self.step = t.take(4)  # high, low, -high, -low of step + 1
    self.low_local, self.low_backup, self.low_in_ram = t.take(1), t.take(1), t.take(1)
    self.low_failed, self.low_busy, self.low_copies = t.take(1), t.take(1), t.take(1)
    # The most calls a node's previous write took, the most ms a process waited for copies.
    self.ready_call, self.copies_wait = t.take(1), t.take(1)
    self.buckets = t.take(4 * shape.buckets)  # per bucket: high, low, -high, -low
    self.add, self.top = a.size, t.size


def _halves4(value: int) -> list[int]:
  high, low = reduction.split(value + 1)
  return [high, low, -high, -low]


def census(record: SaveRecord, me: int, shape: CensusShape) -> Parts:
  """This process's census contribution."""
  lay = _Layout(shape)
  parts = Parts.empty(lay.add, lay.top)
  add, top = parts.add, parts.top
  inv, index = record.inventory, {s: i for i, s in enumerate(shape.slots)}
  fault = record.fault
  local, backup = fault.present and fault.backup_step < 0, fault.present and \
      fault.backup_step >= 0
  add[lay.local_faults], add[lay.backup_faults] = int(local), int(backup)
  add[lay.in_ram], add[lay.in_persistent] = int(record.has_step_in_ram), \
      int(record.has_step_persistent)
  add[lay.wants_backup], add[lay.busy] = int(record.wants_backup), int(record.orbax_busy)
  add[lay.copies_failed] = int(record.copies_failed)
  add[lay.states.start + int(record.backup_state)] = 1
  if me == 0:  # process 0's clock decides backups by minutes: a one-hot slot
    add[lay.clock] = reduction.split(record.clock_ms)
  add[lay.no_own] = int(not inv.own_steps)
  for flag, where in ((local, lay.low_local), (backup, lay.low_backup),
                      (record.has_step_in_ram, lay.low_in_ram),
                      (record.backup_state == Status.FAILED, lay.low_failed),
                      (record.orbax_busy, lay.low_busy),
                      (record.copies_failed, lay.low_copies)):
    if flag:
      top[where] = -me
  top[lay.step] = _halves4(record.step)
  top[lay.ready_call], top[lay.copies_wait] = record.copies_ready_call, record.copies_wait_ms
  unknown: set[int] = set()

  def count(vector: slice, step: int) -> None:
    if step in index:
      add[vector.start + index[step]] += 1
    else:
      unknown.add(step)

  for step in inv.own_steps:
    count(lay.own, step)
  for step in inv.persistent_steps:
    count(lay.persistent, step)
  if inv.own_steps:
    count(lay.newest, max(inv.own_steps))
  if inv.persistent_truncated and inv.persistent_steps:
    count(lay.cut, min(inv.persistent_steps))
  for source, step in inv.copies:
    if source != me:  # a node's copy of itself dies with it
      count(lay.copies, step)
  add[lay.unknown] = len(unknown)
  for step in unknown:
    at = lay.buckets.start + 4 * shape.bucket(step)
    top[at:at + 4] = np.maximum(top[at:at + 4], _halves4(step))
  return parts


@dataclasses.dataclass(frozen=True)
class Census:
  """A census's answer (the same on every process).

  Attributes:
    shape: Its slots and buckets.
    steps: The lowest and highest step saved.
    local_faults, backup_faults: Processes reporting a fault of their own, of a backup.
    in_ram, in_persistent: Processes holding the step in their own folder; how many see it
      persistent.
    wants_backup: Some process wants the step backed up.
    busy: Processes where Orbax still writes an earlier backup.
    copies_failed: Processes where the peer copies issued before the save failed.
    copies_ready_call: The most calls after the last save a node's write took (0: unknown).
    copies_wait_ms: The most a process waited for copies' chunks since the last save.
    failed, all_ready: Processes whose pending backup read-back failed; whether every
      process has read it back.
    clock_ms, no_own: Process 0's clock; how many nodes hold no step of their own.
    unknown: How many steps held somewhere are outside the slots (summed over processes).
    found: Steps outside the slots that a bucket names exactly.
    own, persistent, newest, cut, copies: Per slot, the counts described above.
  """

  shape: CensusShape
  steps: tuple[int, int]
  local_faults: Who
  backup_faults: Who
  in_ram: Who
  in_persistent: int
  wants_backup: bool
  busy: Who
  copies_failed: Who
  copies_ready_call: int
  copies_wait_ms: int
  failed: Who
  all_ready: bool
  clock_ms: int
  no_own: int
  unknown: int
  found: tuple[int, ...]
  own: np.ndarray
  persistent: np.ndarray
  newest: np.ndarray
  cut: np.ndarray
  copies: np.ndarray


def read_census(reduced: Parts, shape: CensusShape, processes: int) -> Census:
  """The answer of a reduced census."""
  lay = _Layout(shape)
  add, top = reduced.add.astype(np.int64), reduced.top.astype(np.int64)

  def who(count: slice, low: slice) -> Who:
    return Who(int(add[count][0]), int(-top[low][0]) if add[count][0] else -1)

  high, low, neg_high, neg_low = top[lay.step]
  states = add[lay.states]
  found = []
  for b in range(shape.buckets):
    h, lo, nh, nl = top[lay.buckets.start + 4 * b:lay.buckets.start + 4 * b + 4]
    if h != LOW and h == -nh and lo == -nl:
      found.append(reduction.join(h, lo) - 1)
  return Census(
      shape=shape, steps=(reduction.join(-neg_high, -neg_low) - 1,
                          reduction.join(high, low) - 1),
      local_faults=who(lay.local_faults, lay.low_local),
      backup_faults=who(lay.backup_faults, lay.low_backup),
      in_ram=who(lay.in_ram, lay.low_in_ram), in_persistent=int(add[lay.in_persistent][0]),
      wants_backup=bool(add[lay.wants_backup][0]), busy=who(lay.busy, lay.low_busy),
      copies_failed=who(lay.copies_failed, lay.low_copies),
      copies_ready_call=max(0, int(top[lay.ready_call][0])),
      copies_wait_ms=max(0, int(top[lay.copies_wait][0])),
      failed=Who(int(states[Status.FAILED]),
                 int(-top[lay.low_failed][0]) if states[Status.FAILED] else -1),
      all_ready=int(states[Status.READY]) == processes,
      clock_ms=reduction.join(*add[lay.clock]), no_own=int(add[lay.no_own][0]),
      unknown=int(add[lay.unknown][0]), found=tuple(sorted(found)),
      own=add[lay.own], persistent=add[lay.persistent], newest=add[lay.newest],
      cut=add[lay.cut], copies=add[lay.copies])


def next_shape(census_: Census) -> CensusShape:
  """The next census's shape: the steps found get slots; more buckets, another hash."""
  shape = census_.shape
  return CensusShape(tuple(sorted(set(shape.slots) | set(census_.found))),
                     min(4 * shape.buckets, MAX_BUCKETS), shape.salt + 1)


def census_bytes(slots: int, buckets: int = FIRST_BUCKETS) -> int:
  """Bytes of one census contribution at any process count: 4 x (21 + 5 x slots) summed,
  4 x (12 + 4 x buckets) maxed."""
  lay = _Layout(CensusShape(tuple(range(slots)), buckets))
  return 4 * (lay.add + lay.top)


def bytes_per_process(processes: int, slots: int, lacking: int = 0) -> int:
  """Bytes one process receives in a save agreement without faults: the census (one round
  when the agreed lists name every step held), plus the coverage round when `lacking` steps
  are missing from some nodes' own folders (one byte per node and step)."""
  received = reduction.received_bytes(census_bytes(slots), processes)
  if lacking:
    received += reduction.received_bytes(lacking * processes, processes)
  return received


def seed(steps: Sequence[int], step: int) -> CensusShape:
  """The first census's shape: the newest `SEED_SLOTS` agreed steps and the step saved."""
  kept = sorted({int(s) for s in (*steps, step) if s >= 0}, reverse=True)[:SEED_SLOTS]
  return CensusShape(tuple(sorted(kept)))


# ----------------------------------------------------------------------------- coverage


def partial_steps(census_: Census, processes: int) -> tuple[int, ...]:
  """Steps held somewhere but not in every node's own folder (the coverage round's)."""
  return tuple(s for i, s in enumerate(census_.shape.slots)
               if census_.own[i] < processes and census_.own[i] + census_.copies[i] > 0)


def coverage(record: SaveRecord, me: int, processes: int, groups: Sequence[int] | None,
             steps: Sequence[int]) -> Parts:
  """One byte per (step, node): 1 where this process can serve that node's data of the step
  (step_listing.restorable_steps's own folder, twin or peer copy)."""
  parts = Parts.empty(0, 0, len(steps) * processes)
  flags = parts.flags.reshape(len(steps), processes) if steps else parts.flags
  group = None if groups is None else np.asarray(groups) == np.asarray(groups)[me]
  own = set(record.inventory.own_steps)
  for k, step in enumerate(steps):
    if step in own:
      flags[k, me] = 1
      if group is not None:
        flags[k, group] = 1
    for source, held in record.inventory.copies:
      if held == step and source != me and 0 <= source < processes:
        flags[k, source] = 1
  return parts


def restorable(census_: Census, partial: Sequence[int], covered: Parts | None,
               processes: int) -> tuple[int, ...]:
  """The RAM steps the cluster can assemble (step_listing.restorable_steps), oldest first."""
  full = {s for i, s in enumerate(census_.shape.slots) if census_.own[i] == processes}
  if partial and covered is not None:
    flags = covered.flags.reshape(len(partial), processes)
    full |= {s for k, s in enumerate(partial) if flags[k].all()}
  return tuple(sorted(full))


# ----------------------------------------------------------------------------- lists


def floor(census_: Census, processes: int) -> int | None:
  """The newest step every node holds in its own folder (kept beyond max_to_keep), or None
  for one process or when some node holds none."""
  if processes <= 1 or census_.no_own:
    return None
  held = [s for i, s in enumerate(census_.shape.slots) if census_.newest[i]]
  return min(held) if held else None


def persistent_lists(census_: Census, processes: int, own_view: Sequence[int]
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(agreed, seen): the persistent steps every process sees and those some process sees, as
  agreement.agreed_persistent_steps and persistent_steps_seen decide from the rows."""
  slots = census_.shape.slots
  common = {s for i, s in enumerate(slots) if census_.persistent[i] == processes}
  seen = {s for i, s in enumerate(slots) if census_.persistent[i] > 0}
  cut = max((s for i, s in enumerate(slots) if census_.cut[i]), default=None)
  if cut is not None:
    common = {s for s in common if s >= cut} | {s for s in own_view if s < cut}
    seen |= {s for s in own_view if s < cut}
  return tuple(sorted(common)), tuple(sorted(seen))


# ----------------------------------------------------------------------------- errors


@dataclasses.dataclass(frozen=True)
class NamesShape:
  """An error round's shape: the steps' range, and the processes (bitmaps)."""
  steps: tuple[int, int]
  processes: int


def names(record: SaveRecord, me: int, shape: NamesShape) -> Parts:
  """Who saves the lowest and the highest step, and which processes hold which fault."""
  words = reduction.bitmap_words(shape.processes)
  parts = Parts.empty(2 + 2 * words, 2)
  low, high = shape.steps
  for i, edge in enumerate((low, high)):
    if record.step == edge:
      parts.add[i] += 1
      parts.top[i] = -me
  fault = record.fault
  if fault.present:
    start = 2 + (0 if fault.backup_step < 0 else words)
    reduction.pack_bit(parts.add[start:start + words], me)
  return parts


@dataclasses.dataclass(frozen=True)
class Names:
  """An error round's answer.

  Attributes:
    low, high: (step, lowest process saving it, how many save it) for the two edges.
    local, backup: The processes with a fault of their own, of a backup (ascending).
  """

  low: tuple[int, int, int]
  high: tuple[int, int, int]
  local: tuple[int, ...]
  backup: tuple[int, ...]


def read_names(reduced: Parts, shape: NamesShape) -> Names:
  """The answer of a reduced names round."""
  words = reduction.bitmap_words(shape.processes)
  add, top = reduced.add, reduced.top
  edges = [(shape.steps[i], int(-top[i]), int(add[i])) for i in range(2)]
  return Names(edges[0], edges[1],
               tuple(int(p) for p in reduction.unpack_bits(add[2:2 + words], shape.processes)),
               tuple(int(p) for p in reduction.unpack_bits(add[2 + words:], shape.processes)))


def steps_differ_message(found: Names, restoring: bool = False) -> str:
  """The error of processes saving (or restoring: -1 is None) different steps."""
  def edge(e: tuple[int, int, int]) -> str:
    step, lowest, count = e
    others = f" and {count - 1} other process(es)" if count > 1 else ""
    return f"process {lowest}{others}: {'None' if restoring and step < 0 else step}"
  verb, advice = ("restore", "restore the same step; use step = mgr.latest_step(), which is "
                  "the same on every process.") if restoring else (
                  "save", "save the same step at the same point of the loop.")
  return (f"{verb}() was called with different steps on different processes: "
          f"{edge(found.low)}, {edge(found.high)}. Every process must {advice}")


def speakers(found: Names) -> tuple[int, ...]:
  """Whose fault messages travel: the lowest local faults, else the lowest failed backup."""
  return found.local[:NAMED_FAULTS] if found.local else found.backup[:1]


def messages(record: SaveRecord, me: int, chosen: Sequence[int]) -> Parts:
  """This process's fault in its own slot, if it is among `chosen`."""
  parts = Parts.empty(len(chosen) * _FAULT_ROW, 0)
  if me in chosen:
    at = list(chosen).index(me) * _FAULT_ROW
    parts.add[at:at + _FAULT_ROW] = agreement.encode(record.fault).view(np.int32)
  return parts


def read_messages(reduced: Parts, chosen: Sequence[int]) -> dict[int, agreement.Fault]:
  """The faults of the chosen processes."""
  return {p: agreement.decode(agreement.Fault, np.ascontiguousarray(
      reduced.add[i * _FAULT_ROW:(i + 1) * _FAULT_ROW]).view(np.int64))
          for i, p in enumerate(chosen)}


# ----------------------------------------------------------------------------- the rounds


@dataclasses.dataclass(frozen=True)
class SaveAnswer:
  """The save agreement's answer (the same on every process).

  Attributes:
    census: The last census.
    steps_error: Why the processes' steps differ (a ValueError to raise), or None.
    ram: The RAM steps the cluster can assemble, oldest first.
    floor: The newest step every node holds, or None.
    persistent, persistent_seen: The persistent steps every process sees, some process sees.
    local, local_count: The named processes' own faults (the lowest `NAMED_FAULTS`), and how
      many processes report one.
    backup: The lowest failed backup's process and fault, when no process has its own.
    rounds: The collectives made, in order (census, coverage, names, messages).
  """

  census: Census
  steps_error: str | None
  ram: tuple[int, ...]
  floor: int | None
  persistent: tuple[int, ...]
  persistent_seen: tuple[int, ...]
  local: dict[int, agreement.Fault]
  local_count: int
  backup: tuple[int, agreement.Fault] | None
  rounds: tuple[Parts, ...]


def agree(record: SaveRecord, me: int, processes: int, groups: Sequence[int] | None,
          agreed_steps: Sequence[int], own_view: Sequence[int],
          reduce: Callable[[reduction.Round], Parts], *, restoring: bool = False) -> SaveAnswer:
  """Runs the save agreement's rounds; every branch reads only reduced data (rule 8).

  Args:
    record: This process's facts.
    me: This process's index.
    processes: The process count.
    groups: Per process, its twins' group id (step_listing), or None.
    agreed_steps: Steps already agreed (the slots of the first census).
    own_view: The persistent steps this process sees (steps older than a cut list).
    reduce: The collective: a round's reduced `Parts`.
    restoring: The restore's census (`record.step`: the step asked for, -1 for None).
  """
  rounds: list[Parts] = []

  def run(contribute: Callable[[SaveRecord, int], Parts]) -> Parts:
    reduced = reduce(reduction.Round(record, me, contribute))
    rounds.append(reduced)
    return reduced

  shape = seed(agreed_steps, record.step)
  for _ in range(MAX_CENSUSES):
    found = read_census(run(lambda r, p, s=shape: census(r, p, s)), shape, processes)
    if not found.unknown:
      break
    shape = next_shape(found)
  else:  # agreed data: every process raises alike
    raise RuntimeError(f"orbax-mtc: {found.unknown} steps held by the processes could not be "
                       f"named in {MAX_CENSUSES} censuses (more distinct steps than "
                       f"{MAX_BUCKETS} buckets can tell apart)")
  partial = partial_steps(found, processes)
  covered = run(lambda r, p: coverage(r, p, processes, groups, partial)) if partial else None
  steps_differ = found.steps[0] != found.steps[1]
  named = None
  if steps_differ or found.local_faults or found.backup_faults:
    name_shape = NamesShape(found.steps, processes)
    named = read_names(run(lambda r, p: names(r, p, name_shape)), name_shape)
  local: dict[int, agreement.Fault] = {}
  backup = None
  if named is not None and not steps_differ and (named.local or named.backup):
    chosen = speakers(named)
    told = read_messages(run(lambda r, p: messages(r, p, chosen)), chosen)
    if named.local:
      local = told
    else:
      backup = (chosen[0], told[chosen[0]])
  agreed, seen = persistent_lists(found, processes, own_view)
  return SaveAnswer(
      census=found,
      steps_error=steps_differ_message(named, restoring) if steps_differ and named else None,
      ram=restorable(found, partial, covered, processes), floor=floor(found, processes),
      persistent=agreed, persistent_seen=seen, local=local,
      local_count=found.local_faults.count, backup=backup, rounds=tuple(rounds))
