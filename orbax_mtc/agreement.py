"""The one agreed record per public call: what every process tells the others, and the codes.

Rule 8 of the design: every answer that steers the training loop is the same on every process,
and every branch taken before a collective depends only on agreed data. Per-process facts (the
steps in this node's RAM folder, its view of the persistent tier, an error on its writer
thread) therefore enter decisions only through one record per call, all-gathered once. Each
record is a frozen dataclass whose fields carry their codec; `encode`/`decode` here are the only
place that knows the layout of the int64 row, so no caller reads a column by index.

Pure: numpy only, no I/O and no JAX, so every record round-trips in unit tests.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import numpy as np


class Status(enum.IntEnum):
  """Every per-process state that crosses an agreement (one set of codes for all modules)."""

  NONE = 0  # nothing to report (e.g. no backup pending)
  OK = 1  # the restore source was read and built
  WRITING = 2  # the step's local write still runs
  COMMITTED = 3  # the step is committed in this node's RAM folder
  READING = 4  # a pending backup's RAM read-back still runs
  READY = 5  # a pending backup's RAM read-back is done
  FAILED = 6  # this process failed (write, read-back, transfer)
  UNUSABLE = 7  # this source is corrupt or incomplete: try another
  MISMATCH = 8  # the restore target does not match what was saved (caller's error)


# ----------------------------------------------------------------------------- codecs


class _Codec:
  size: int

  def encode(self, value: Any) -> list[int]:
    raise NotImplementedError

  def decode(self, slots: np.ndarray) -> Any:
    raise NotImplementedError


class _Int(_Codec):
  size = 1

  def encode(self, value: Any) -> list[int]:
    return [int(value)]

  def decode(self, slots: np.ndarray) -> int:
    return int(slots[0])


class _Bool(_Int):
  def decode(self, slots: np.ndarray) -> bool:  # type: ignore[override]
    return bool(slots[0])


class _Enum(_Int):
  def __init__(self, enum_type: type[enum.IntEnum]):
    self.enum_type = enum_type

  def decode(self, slots: np.ndarray) -> enum.IntEnum:  # type: ignore[override]
    return self.enum_type(int(slots[0]))


class _Steps(_Codec):
  """Up to `width` non-negative ints, newest first; a count says how many were sent and
  whether the list was cut."""

  def __init__(self, width: int):
    self.width = width
    self.size = 2 + width

  def encode(self, value: Collection[int]) -> list[int]:
    values = sorted({int(v) for v in value}, reverse=True)
    kept = values[:self.width]
    return [len(kept), int(len(values) > self.width)] + kept + [-1] * (self.width - len(kept))

  def decode(self, slots: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in slots[2:2 + int(slots[0])])

  @staticmethod
  def truncated(slots: np.ndarray) -> bool:
    return bool(slots[1])


class _Pairs(_Codec):
  """Up to `width` (a, b) pairs of non-negative ints, newest b first."""

  def __init__(self, width: int):
    self.width = width
    self.size = 1 + 2 * width

  def encode(self, value: Collection[tuple[int, int]]) -> list[int]:
    pairs = sorted({(int(a), int(b)) for a, b in value}, key=lambda p: (-p[1], p[0]))
    kept = pairs[:self.width]
    flat = [x for pair in kept for x in pair]
    return [len(kept)] + flat + [-1] * (2 * (self.width - len(kept)))

  def decode(self, slots: np.ndarray) -> tuple[tuple[int, int], ...]:
    n = int(slots[0])
    flat = slots[1:1 + 2 * n]
    return tuple((int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(n))


class _Text(_Codec):
  """UTF-8 text cut to `nbytes` (on a character boundary), packed eight bytes a slot."""

  def __init__(self, nbytes: int):
    self.nbytes = -(-nbytes // 8) * 8
    self.size = 1 + self.nbytes // 8

  def encode(self, value: str) -> list[int]:
    raw = value.encode("utf-8")[:self.nbytes].decode("utf-8", "ignore").encode("utf-8")
    padded = raw + b"\0" * (self.nbytes - len(raw))
    return [len(raw)] + np.frombuffer(padded, dtype=np.int64).tolist()

  def decode(self, slots: np.ndarray) -> str:
    raw = np.asarray(slots[1:], dtype=np.int64).tobytes()[:int(slots[0])]
    return raw.decode("utf-8", "replace")


class _Record(_Codec):
  def __init__(self, record_type: type):
    self.record_type = record_type
    self.size = row_size(record_type)

  def encode(self, value: Any) -> list[int]:
    return encode(value).tolist()

  def decode(self, slots: np.ndarray) -> Any:
    return decode(self.record_type, slots)


def _field(codec: _Codec, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
  if factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=factory, metadata={"codec": codec})
  return dataclasses.field(default=default, metadata={"codec": codec})


def _codecs(record_type: type) -> list[tuple[str, _Codec]]:
  return [(f.name, f.metadata["codec"]) for f in dataclasses.fields(record_type)]


def row_size(record_type: type) -> int:
  """Number of int64 values in the row of a record type.

  Args:
    record_type: A record dataclass of this module.

  Returns:
    The sum of the sizes of its fields' codecs.
  """
  return sum(codec.size for _, codec in _codecs(record_type))


def encode(record: Any) -> np.ndarray:
  """Encodes a record as one int64 row (the only writer of the layout).

  Args:
    record: An instance of a record dataclass of this module.

  Returns:
    A 1-D int64 array of `row_size(type(record))` values.
  """
  row: list[int] = []
  for name, codec in _codecs(type(record)):
    slots = codec.encode(getattr(record, name))
    assert len(slots) == codec.size, (name, len(slots), codec.size)
    row += slots
  return np.asarray(row, dtype=np.int64)


R = TypeVar("R")


def decode(record_type: type[R], row: np.ndarray) -> R:
  """Decodes the record `encode` wrote into `row` (the only reader of the layout).

  Args:
    record_type: The record dataclass that was encoded.
    row: The int64 values (any shape; flattened).

  Returns:
    The decoded record.

  Raises:
    ValueError: If `row` does not have `row_size(record_type)` values (e.g. processes run
      different orbax-mtc versions).
  """
  row = np.asarray(row, dtype=np.int64).reshape(-1)
  if row.size != row_size(record_type):
    raise ValueError(f"{record_type.__name__}: a row of {row.size} values, expected "
                     f"{row_size(record_type)} (processes run different orbax-mtc versions?)")
  values, at = {}, 0
  for name, codec in _codecs(record_type):
    values[name] = codec.decode(row[at:at + codec.size])
    at += codec.size
  return record_type(**values)


def gather(record: R, allgather: Callable[[np.ndarray], np.ndarray]) -> list[R]:
  """Gathers every process's record (one all-gather: a collective).

  Args:
    record: This process's record.
    allgather: Stacks a row of every process (index = process), e.g.
      `collectives.allgather` bound to its other arguments.

  Returns:
    The records of every process, index = process.
  """
  rows = np.asarray(allgather(encode(record)))
  rows = rows.reshape(-1, rows.shape[-1])
  return [decode(type(record), row) for row in rows]


def gather_with_sizes(record: R, sizes: np.ndarray, allgather: Callable[[np.ndarray], np.ndarray]
                      ) -> list[tuple[R, np.ndarray]]:
    """Like `gather`, with a vector of byte counts after the record.

    Args:
      record: This process's record.
      sizes: Byte counts, one per stream of an exchange, the same length on every process.
      allgather: Stacks a row of every process (index = process).

    Returns:
      (record, sizes) of every process, index = process.
    """
    row = np.concatenate([encode(record), np.asarray(sizes, dtype=np.int64).reshape(-1)])
    rows = np.asarray(allgather(row))
    rows = rows.reshape(-1, rows.shape[-1])
    width = row_size(type(record))
    return [(decode(type(record), r[:width]), r[width:].copy()) for r in rows]


# ----------------------------------------------------------------------------- records

_STEPS_WIDTH = 32  # retention keeps far fewer RAM steps; older ones are simply not listed
_MESSAGE_BYTES = 1200  # enough for a leaf path, two shardings and a folder


@dataclasses.dataclass(frozen=True)
class Fault:
  """An error one process hit, carried to every other (rule 9). Empty kind: no fault.

  Attributes:
    kind: The exception's type name; empty for no fault.
    message: The exception's message, cut to fit the row.
    backup_step: >= 0: a failed persistent backup of this step; -1 otherwise.
  """

  kind: str = _field(_Text(48), "")  # the exception's type name
  message: str = _field(_Text(_MESSAGE_BYTES), "")
  backup_step: int = _field(_Int(), -1)  # >= 0: a failed persistent backup of this step

  @property
  def present(self) -> bool:
    """True if this records a fault."""
    return bool(self.kind)

  @classmethod
  def of(cls, error: BaseException | None, *, backup_step: int = -1) -> Fault:
    """Builds the fault of an exception.

    Args:
      error: The exception, or None for no fault.
      backup_step: The step of a failed persistent backup, or -1.

    Returns:
      The `Fault`; an empty one when `error` is None.
    """
    if error is None:
      return cls()
    return cls(kind=type(error).__name__, message=str(error), backup_step=backup_step)


@dataclasses.dataclass(frozen=True)
class Inventory:
  """What one node can serve (newest first, at most `_STEPS_WIDTH` of each list).

  Attributes:
    own_steps: Committed steps in the node's own RAM folder.
    copies: Peer copies it holds, as (source rank, step).
    persistent_steps: The persistent steps it sees.
    persistent_truncated: True if `persistent_steps` was cut to `_STEPS_WIDTH`.
  """

  own_steps: tuple[int, ...] = _field(_Steps(_STEPS_WIDTH), ())
  copies: tuple[tuple[int, int], ...] = _field(_Pairs(_STEPS_WIDTH), ())
  persistent_steps: tuple[int, ...] = _field(_Steps(_STEPS_WIDTH), ())
  persistent_truncated: bool = _field(_Bool(), False)

  @classmethod
  def of(cls, own_steps: Collection[int], copies: Collection[tuple[int, int]],
         persistent_steps: Collection[int]) -> Inventory:
    """Builds an inventory, keeping the newest `_STEPS_WIDTH` steps of each list.

    Args:
      own_steps: Committed steps in the node's own RAM folder.
      copies: Peer copies it holds, as (source rank, step).
      persistent_steps: The persistent steps it sees.

    Returns:
      The `Inventory`.
    """
    return cls(own_steps=tuple(sorted(set(own_steps), reverse=True)[:_STEPS_WIDTH]),
               copies=tuple(copies), persistent_steps=tuple(
                   sorted(set(persistent_steps), reverse=True)[:_STEPS_WIDTH]),
               persistent_truncated=len(set(persistent_steps)) > _STEPS_WIDTH)


@dataclasses.dataclass(frozen=True)
class StartRecord:
  """Construction: whether this process could claim and prepare its local directory.

  Attributes:
    fault: The error it hit, if any.
    inventory: What it holds.
  """

  fault: Fault = _field(_Record(Fault), factory=Fault)
  inventory: Inventory = _field(_Record(Inventory), factory=Inventory)


@dataclasses.dataclass(frozen=True)
class SaveRecord:
  """One local save (every process saves the same steps, so it is gathered everywhere).

  Attributes:
    step: The step being saved.
    fault: The error this process hit, if any.
    inventory: What this node holds.
    has_step_in_ram: Whether the step already is in this node's RAM folder.
    has_step_persistent: Whether the step already is in the persistent tier.
    wants_backup: Whether this process wants the step backed up to the persistent tier.
    backup_state: Where the pending backup's read-back is.
    orbax_busy: Whether Orbax still writes an earlier backup here.
    clock_ms: This process's clock; process 0's decides backups by minutes.
  """

  step: int = _field(_Int(), -1)
  fault: Fault = _field(_Record(Fault), factory=Fault)
  inventory: Inventory = _field(_Record(Inventory), factory=Inventory)
  has_step_in_ram: bool = _field(_Bool(), False)
  has_step_persistent: bool = _field(_Bool(), False)
  wants_backup: bool = _field(_Bool(), False)
  backup_state: Status = _field(_Enum(Status), Status.NONE)  # the pending backup's read-back
  orbax_busy: bool = _field(_Bool(), False)  # Orbax still writes an earlier backup here
  clock_ms: int = _field(_Int(), 0)  # process 0's clock decides backups by minutes


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
  """One restore: the step asked for and what this node can serve.

  Attributes:
    requested_step: The step asked for; -1 for the newest.
    fault: The error this process hit, if any.
    inventory: What this node holds.
  """

  requested_step: int = _field(_Int(), -1)
  fault: Fault = _field(_Record(Fault), factory=Fault)
  inventory: Inventory = _field(_Record(Inventory), factory=Inventory)


@dataclasses.dataclass(frozen=True)
class SendRecord:
  """Peer replication of one step; its byte count per copy edge follows (`gather_with_sizes`).

  Attributes:
    status: Whether this node committed the step: WRITING, COMMITTED or FAILED.
  """

  status: Status = _field(_Enum(Status), Status.WRITING)


@dataclasses.dataclass(frozen=True)
class ServeRecord:
  """A restore's transfers; its byte count per transfer follows (`gather_with_sizes`).

  Attributes:
    status: Whether this node can serve what it was asked to.
    message: Why not, if it cannot.
  """

  status: Status = _field(_Enum(Status), Status.OK)
  message: str = _field(_Text(_MESSAGE_BYTES), "")


@dataclasses.dataclass(frozen=True)
class BuildRecord:
  """One attempt to build the restore target from a chosen source.

  Attributes:
    status: OK, UNUSABLE (try another source), MISMATCH or FAILED.
    message: What went wrong, if anything.
  """

  status: Status = _field(_Enum(Status), Status.OK)
  message: str = _field(_Text(_MESSAGE_BYTES), "")


@dataclasses.dataclass(frozen=True)
class ReadBackRecord:
  """Flushing a pending backup.

  Attributes:
    state: Where this node is with reading it back from RAM.
  """

  state: Status = _field(_Enum(Status), Status.NONE)


@dataclasses.dataclass(frozen=True)
class OnDemandRecord:
  """The on-demand save after its RAM write. Orbax's save has barriers, so all must agree.

  Attributes:
    fault: The error this process hit, if any.
    wants_backup: Whether this node wants the persistent backup.
    in_budget: Whether this node has the time for it.
  """

  fault: Fault = _field(_Record(Fault), factory=Fault)
  wants_backup: bool = _field(_Bool(), False)
  in_budget: bool = _field(_Bool(), False)


@dataclasses.dataclass(frozen=True)
class EntryRecord:
  """Managed mode: the step this worker's replicator `.restore` entry names.

  Attributes:
    step: That step; -1 for none.
    readable: Whether this node holds it in its own folder.
  """

  step: int = _field(_Int(), -1)
  readable: bool = _field(_Bool(), False)


@dataclasses.dataclass(frozen=True)
class FinishRecord:
  """`wait_until_finished` / `reload`: errors still to report, and what each node holds.

  Attributes:
    fault: The error this process still has to report, if any.
    inventory: What this node holds.
  """

  fault: Fault = _field(_Record(Fault), factory=Fault)
  inventory: Inventory = _field(_Record(Inventory), factory=Inventory)


# ----------------------------------------------------------------------------- decisions


class CheckpointError(RuntimeError):
  """A checkpoint operation failed on one or more processes; raised on every process alike.

  Args:
    what: The operation that failed, named in the message.
    origins: Each failing process -> its error, as "<type>: <message>".

  Attributes:
    origins: A copy of `origins`.
  """

  def __init__(self, what: str, origins: dict[int, str]):
    listed = "; ".join(f"process {p}: {cause}" for p, cause in sorted(origins.items()))
    super().__init__(f"orbax-mtc: {what} failed on process(es) {sorted(origins)}: {listed}. "
                     "Every process raises this error; committed steps are untouched.")
    self.origins = dict(origins)


def faults(records: Sequence[Any]) -> dict[int, Fault]:
  """Collects the faults the processes report.

  Args:
    records: One gathered record per process, each with a `fault` field.

  Returns:
    Process -> its fault, for the processes that report one.
  """
  return {p: r.fault for p, r in enumerate(records) if r.fault.present}


def raise_faults(records: Sequence[Any], what: str) -> None:
  """Raises one CheckpointError, the same on every process, if any process reports a fault.

  Args:
    records: One gathered record per process, each with a `fault` field.
    what: The operation, named in the error.

  Raises:
    CheckpointError: If any record carries a fault.
  """
  found = faults(records)
  if found:
    raise CheckpointError(what, {p: f"{f.kind}: {f.message}" for p, f in found.items()})


def agreed_persistent_steps(inventories: Sequence[Inventory],
                            own_view: Collection[int]) -> tuple[int, ...]:
  """Persistent steps every process sees (a process's view can lag after a failed finalize).

  Steps older than what a cut inventory carried come from this process's own view: old steps
  are settled, and every process sees the same there.

  Args:
    inventories: One gathered inventory per process.
    own_view: The persistent steps this process sees.

  Returns:
    The agreed persistent steps, oldest first.
  """
  if not inventories:
    return tuple(sorted(own_view))
  common = set.intersection(*(set(inv.persistent_steps) for inv in inventories))
  cut = [min(inv.persistent_steps) for inv in inventories
         if inv.persistent_truncated and inv.persistent_steps]
  if cut:
    floor = max(cut)
    common = {s for s in common if s >= floor} | {s for s in own_view if s < floor}
  return tuple(sorted(common))
