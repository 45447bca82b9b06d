"""The one agreed record per public call: what every process tells the others, and the codes.

Rule 8 of the design: every answer that steers the training loop is the same on every process,
and every branch taken before a collective depends only on agreed data. Per-process facts (the
steps in this node's RAM folder, its view of the persistent tier, an error on its writer
thread) therefore enter decisions only through one record per call, agreed by reductions
whose size does not grow with the cluster (save_census, restore/census, restore/outcome,
peers/send_census, summary). Each record is a frozen dataclass whose fields carry their codec;
`encode`/`decode` (row_codec.py, re-exported here) are the only place that knows the layout of
its int64 row (a fault's message travels as one), so no caller reads a column by index.

Pure: numpy only, no I/O and no JAX, so every record round-trips in unit tests.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Sequence
from typing import Any

# Re-exported: this error lived here before errors.py; other modules name it through this one.
from orbax_mtc.errors import CheckpointError as CheckpointError
from orbax_mtc.row_codec import (
  Blob,
  Bool,
  EnumCodec,
  Int,
  Pairs,
  Record,
  Steps,
  Text,
  field,
)

# The codec's entry points, used as agreement.encode(...) and friends.
from orbax_mtc.row_codec import decode as decode
from orbax_mtc.row_codec import encode as encode
from orbax_mtc.row_codec import row_size as row_size


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
  LACKING = 9  # this folder lacks a per-process item asked for: another copy may have it


# ----------------------------------------------------------------------------- records

_STEPS_WIDTH = 32  # retention keeps far fewer RAM steps; older ones are simply not listed
_MESSAGE_BYTES = 1200  # enough for a leaf path, two shardings and a folder
ELASTIC_REPORT_BYTES = 1024  # one host's elastic report (elastic_plan.HostReport)


@dataclasses.dataclass(frozen=True)
class Fault:
  """An error one process hit, carried to every other (rule 9). Empty kind: no fault.

  Attributes:
    kind: The exception's type name; empty for no fault.
    message: The exception's message, cut to fit the row.
    backup_step: >= 0: a failed persistent backup of this step; -1 otherwise.
  """

  kind: str = field(Text(48), "")  # the exception's type name
  message: str = field(Text(_MESSAGE_BYTES), "")
  backup_step: int = field(Int(), -1)  # >= 0: a failed persistent backup of this step

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

  own_steps: tuple[int, ...] = field(Steps(_STEPS_WIDTH), ())
  copies: tuple[tuple[int, int], ...] = field(Pairs(_STEPS_WIDTH), ())
  persistent_steps: tuple[int, ...] = field(Steps(_STEPS_WIDTH), ())
  persistent_truncated: bool = field(Bool(), False)

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
  """Construction: whether this process could claim and prepare its local directory, or
  make the replicator's handshake (summarized: summary.py).

  Attributes:
    fault: The error it hit, if any.
  """

  fault: Fault = field(Record(Fault), factory=Fault)


@dataclasses.dataclass(frozen=True)
class SaveRecord:
  """One local save (every process saves the same steps, so every process agrees it).

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
    copies_failed: Whether the peer copies issued before this save failed here (a read,
      placement or receive): their outcome rides in the save's agreement.
    copies_ready_call: The first call after the previous local save that found its write
      done here (0: none known); the latest one sets when the next copies start.
    copies_wait_ms: How long this process's calls waited for peer copies' chunks since the
      previous local save; the most any waited sets how widely the next copies are spread.
  """

  step: int = field(Int(), -1)
  fault: Fault = field(Record(Fault), factory=Fault)
  inventory: Inventory = field(Record(Inventory), factory=Inventory)
  has_step_in_ram: bool = field(Bool(), False)
  has_step_persistent: bool = field(Bool(), False)
  wants_backup: bool = field(Bool(), False)
  backup_state: Status = field(EnumCodec(Status), Status.NONE)  # the pending backup's read-back
  orbax_busy: bool = field(Bool(), False)  # Orbax still writes an earlier backup here
  clock_ms: int = field(Int(), 0)  # process 0's clock decides backups by minutes
  copies_failed: bool = field(Bool(), False)  # the copies issued before it failed here
  copies_ready_call: int = field(Int(), 0)  # the call the previous write was done by here
  copies_wait_ms: int = field(Int(), 0)  # waited for copies' chunks since the last save


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
  """One restore's facts as they were all-gathered before the restore agreement became
  reductions (save_census, restore/census): the baseline `orbax-mtc bench elastic-scale`
  compares with.

  Attributes:
    requested_step: The step asked for; -1 for the newest.
    fault: The error this process hit, if any.
    inventory: What this node holds.
    elastic: Every folder it holds by saved rank, count and layout
      (`elastic_plan.HostReport.encode`), for a restore on another layout.
  """

  requested_step: int = field(Int(), -1)
  fault: Fault = field(Record(Fault), factory=Fault)
  inventory: Inventory = field(Record(Inventory), factory=Inventory)
  elastic: bytes = field(Blob(ELASTIC_REPORT_BYTES), b"")


@dataclasses.dataclass(frozen=True)
class SendRecord:
  """Peer replication of one step, as an all-gather carried it before send_census (its byte
  count per copy edge followed): the scale bench's "before" figure.

  Attributes:
    status: Whether this node committed the step: WRITING, COMMITTED or FAILED.
  """

  status: Status = field(EnumCodec(Status), Status.WRITING)


@dataclasses.dataclass(frozen=True)
class OutcomeRecord:
  """One process's outcome of a check before Orbax's own collective (summarized).

  Attributes:
    fault: Why the check failed here; none when it passed.
  """

  fault: Fault = field(Record(Fault), factory=Fault)


@dataclasses.dataclass(frozen=True)
class ClockRecord:
  """When the newest agreed persistent step was committed, as this process reads it.

  Attributes:
    commit_ms: Milliseconds since the epoch; 0 when this process could not read it.
  """

  commit_ms: int = field(Int(), 0)


@dataclasses.dataclass(frozen=True)
class SaveCostRecord:
  """What the RAM tier's previous save cycle cost this process's loop
  (`LocalCheckpointOptions.save_overhead_budget`).

  Attributes:
    cost_us: Microseconds inside `save()` that worked for that save (its calls' time above
      the cheapest call's, policy.SaveCost); 0 before the first cycle.
    call_us: Microseconds between two `save()` calls in that cycle, on average (a training
      step); 0 before the first cycle.
  """

  cost_us: int = field(Int(), 0)
  call_us: int = field(Int(), 0)


@dataclasses.dataclass(frozen=True)
class BuildRecord:
  """One process's attempt to build the restore targets.

  Attributes:
    status: OK, UNUSABLE (try another source), MISMATCH or FAILED.
    bad_process: The process that sent a bad tile, or -1.
    bad_rank: The saved rank of that tile, or -1.
    moved: Some target shard here is not a saved tile of this process's own rank (another
      layout): every process writes the step back in the new one.
    in_place: This process's saved rank came from its own current folder.
    message: What went wrong, if anything.
  """

  status: Status = field(EnumCodec(Status), Status.OK)
  bad_process: int = field(Int(), -1)
  bad_rank: int = field(Int(), -1)
  moved: bool = field(Bool(), False)
  in_place: bool = field(Bool(), False)
  message: str = field(Text(_MESSAGE_BYTES), "")


@dataclasses.dataclass(frozen=True)
class ServeRecord:
  """A restore's exchange: this process's serving status (reduced by
  restore/outcome.agree_serve; the streams by peers/exchange.agree_streams).

  Attributes:
    status: OK; UNUSABLE (damaged folders, `failed_ranks`); LACKING (folders without a
      per-process item asked for, `failed_ranks`); MISMATCH (the target); FAILED (any other
      error: raised everywhere).
    failed_ranks: The saved ranks this process could not serve.
    message: Why not.
    early: The outcome of a build made before the exchange (NONE: none was, since this
      process receives bytes, or cannot serve).
  """

  status: Status = field(EnumCodec(Status), Status.OK)
  failed_ranks: tuple[int, ...] = field(Steps(32), ())
  message: str = field(Text(_MESSAGE_BYTES), "")
  early: BuildRecord = field(Record(BuildRecord), factory=lambda: BuildRecord(status=Status.NONE))


@dataclasses.dataclass(frozen=True)
class ReadBackRecord:
  """Flushing a pending backup.

  Attributes:
    state: Where this node is with reading it back from RAM.
  """

  state: Status = field(EnumCodec(Status), Status.NONE)


@dataclasses.dataclass(frozen=True)
class OnDemandRecord:
  """The on-demand save after its RAM write. Orbax's save has barriers, so all must agree.

  Attributes:
    fault: The error this process hit, if any.
    wants_backup: Whether this node wants the persistent backup.
    in_budget: Whether this node has the time for it.
  """

  fault: Fault = field(Record(Fault), factory=Fault)
  wants_backup: bool = field(Bool(), False)
  in_budget: bool = field(Bool(), False)


@dataclasses.dataclass(frozen=True)
class EntryRecord:
  """Managed mode: the step this worker's replicator `.restore` entry names.

  Attributes:
    step: That step; -1 for none.
    readable: Whether this node holds it in its own folder.
  """

  step: int = field(Int(), -1)
  readable: bool = field(Bool(), False)


@dataclasses.dataclass(frozen=True)
class FinishRecord:
  """`wait_until_finished` / `reload`: errors still to report, and what each node holds.

  Attributes:
    fault: The error this process still has to report, if any.
    inventory: What this node holds.
  """

  fault: Fault = field(Record(Fault), factory=Fault)
  inventory: Inventory = field(Record(Inventory), factory=Inventory)


# ----------------------------------------------------------------------------- decisions


def faults(records: Sequence[Any]) -> dict[int, Fault]:
  """Collects the faults the processes report.

  Args:
    records: One gathered record per process, each with a `fault` field.

  Returns:
    Process -> its fault, for the processes that report one.
  """
  return {p: r.fault for p, r in enumerate(records) if r.fault.present}


def persistent_steps_seen(inventories: Sequence[Inventory],
                          own_view: Collection[int]) -> tuple[int, ...]:
  """Persistent steps some process sees (as `agreed_persistent_steps`, a union)."""
  seen = set().union(*(inv.persistent_steps for inv in inventories)) if inventories else set()
  cut = [min(inv.persistent_steps) for inv in inventories
         if inv.persistent_truncated and inv.persistent_steps]
  if cut or not inventories:
    floor = max(cut) if cut else None
    seen |= {s for s in own_view if floor is None or s < floor}
  return tuple(sorted(seen))


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
