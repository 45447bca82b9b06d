"""The step lists every process agreed on, and the faults still to be agreed.

Rule 8: `all_steps`, `latest_step` and every branch before a collective read only agreed
data. A `StepLedger` keeps that data (the RAM steps the cluster can assemble, the persistent
steps every process sees) and gathers one `agreement` record per call to renew it. Rule 9: an
error on one process (a failed RAM write on the writer thread, say) is held here until the
next agreement carries it to every process, which then raises the same error together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from orbax_mtc import agreement, save_census, summary
from orbax_mtc import step_listing as restore_plan
from orbax_mtc.errors import BackupError
from orbax_mtc.reduction import Parts, Round


class UnreportedError:
  """One slot for a writer-thread error until an agreement carries it (rule 9).

  The RAM writer offers its errors here; the ledger takes the one held into the next
  agreement. A further error while one is held is refused (its writer only logs it).
  """

  def __init__(self) -> None:
    self._error: BaseException | None = None

  def offer(self, error: BaseException) -> bool:
    """Keeps `error`; False when one is already kept."""
    if self._error is not None:
      return False
    self._error = error
    return True

  def take(self) -> BaseException | None:
    error, self._error = self._error, None
    return error


class StepLedger:
  """Agreed step lists and unreported faults of one manager.

  Args:
    process_count: processes in the job.
    own_steps: this node's committed RAM steps.
    copies: this node's servable peer copies, as (source, step), given its own steps.
    persistent_steps: the persistent steps this process sees.
    listing_groups: which processes hold the same shards (twins), or None.
    keep: the RAM tier's retention: `keep(steps, floor)`, the steps kept.
    unreported: where the RAM writer leaves its errors for the next agreement.
    before_local_raise: called before an agreed local fault is raised (every process is
      there): lets a backup in flight finish.
    process_index: this process's index.
    allreduce: `allreduce(parts, what)`, the reduction of every process's vectors (a
      collective bounded by the agreement timeout, collectives.allreduce).
    listing_allreduce: the reduction of `agree_steps` (default: `allreduce`); it still runs
      once a newer manager took the RAM folder over, so this one can list and reload.
    reduce: `reduce(round, what)`, in place of both reductions (a simulated cluster adds up
      its processes' contributions to the round).
  """

  def __init__(self, *, process_count: int,
               own_steps: Callable[[], list[int]],
               copies: Callable[[list[int]], list[tuple[int, int]]],
               persistent_steps: Callable[[], list[int]],
               listing_groups: Callable[[], list[int] | None],
               keep: Callable[[Sequence[int], int | None], set[int]],
               unreported: UnreportedError | None = None,
               before_local_raise: Callable[[], None] = lambda: None,
               process_index: int = 0,
               allreduce: Callable[[Parts, str], Parts] | None = None,
               listing_allreduce: Callable[[Parts, str], Parts] | None = None,
               reduce: Callable[[Round, str], Parts] | None = None):
    self.process_count = process_count
    self.process_index = process_index

    def reducer(collective: Callable[[Parts, str], Parts] | None
                ) -> Callable[[Round, str], Parts]:
      def run(rnd: Round, what: str) -> Parts:
        if collective is None:
          if process_count > 1:
            raise ValueError("a ledger of several processes needs `allreduce` or `reduce`")
          return rnd.parts()
        return collective(rnd.parts(), what)
      return run

    self._reduce = reduce or reducer(allreduce)
    self._listing_reduce = reduce or reducer(listing_allreduce or allreduce)
    self._own_steps = own_steps
    self._copies = copies
    self._persistent_steps = persistent_steps
    self._listing_groups = listing_groups
    self._keep = keep
    self.ram: tuple[int, ...] = ()  # RAM steps the cluster can assemble
    self.persistent: tuple[int, ...] = ()  # persistent steps every process sees
    self.persistent_seen: tuple[int, ...] = ()  # persistent steps some process sees
    self._unreported = unreported or UnreportedError()  # not yet handed to an agreement
    self._fault_cause: BaseException | None = None  # handed, not yet raised
    self._before_local_raise = before_local_raise

  # --------------------------------------------------------------------- agreeing

  def summarize(self, record: Any, what: str) -> summary.Summary:
    """Who reports what in every process's record of this call (reductions whose size does
    not grow with the cluster, summary.py; rule 8)."""
    return summary.summarize(record, self.process_index, self.process_count,
                             lambda rnd: self._reduce(rnd, what))

  def agree_save(self, record: agreement.SaveRecord, what: str, *,
                 restoring: bool = False) -> save_census.SaveAnswer:
    """A local save's agreement (or a restore's: `record.step` is the step asked for):
    reductions whose size does not grow with the cluster (save_census; rule 8), the slots
    seeded by the step lists agreed so far."""
    return save_census.agree(
        record, self.process_index, self.process_count, self._listing_groups(),
        [*self.ram, *self.persistent_seen], self._persistent_steps(),
        lambda rnd: self._reduce(rnd, what), restoring=restoring)

  def reduce(self, rnd: Round, what: str, *, listing: bool = False) -> Parts:
    """One round's reduction over every process (a collective; `listing`: the reduction
    that still runs once a newer manager took the RAM folder over)."""
    return (self._listing_reduce if listing else self._reduce)(rnd, what)

  def adopt_answer(self, answer: save_census.SaveAnswer, *, saved: int | None = None,
                   floor: int | None = None) -> None:
    """Takes the agreed step lists from a save agreement's answer (as `adopt` from rows)."""
    ram = list(answer.ram)
    if saved is not None:
      ram = sorted(self._keep([*ram, saved], floor))
    self.ram = tuple(ram)
    self.persistent = answer.persistent
    self.persistent_seen = answer.persistent_seen

  def inventory(self, own_steps: list[int] | None = None,
                persistent_steps: list[int] | None = None) -> agreement.Inventory:
    """What this node can serve now (its part of every steps agreement)."""
    own = self._own_steps() if own_steps is None else own_steps
    persistent = self._persistent_steps() if persistent_steps is None else persistent_steps
    return agreement.Inventory.of(own, self._copies(own), persistent)

  def adopt(self, inventories: Sequence[agreement.Inventory], *, saved: int | None = None,
            floor: int | None = None) -> list[restore_plan.NodeInventory]:
    """Takes the agreed step lists from gathered inventories (the same on every process).

    Args:
      inventories: every process's inventory, index = process.
      saved: a step every process has just started writing to RAM.
      floor: the newest step every node holds (kept beyond max_to_keep).

    Returns:
      The inventories as the restore planner reads them.
    """
    nodes = [restore_plan.NodeInventory(frozenset(inv.own_steps), frozenset(inv.copies))
             for inv in inventories]
    ram = restore_plan.restorable_steps(nodes, self._listing_groups())
    if saved is not None:
      ram = sorted(self._keep([*ram, saved], floor))
    self.ram = tuple(ram)
    own_view = self._persistent_steps()
    self.persistent = agreement.agreed_persistent_steps(inventories, own_view)
    # Some process sees these (a lagging view may not): what delete() must act on.
    self.persistent_seen = agreement.persistent_steps_seen(inventories, own_view)
    return nodes

  def add_ram(self, steps: Sequence[int]) -> None:
    """Lists RAM steps found outside the inventories (saved on another layout, rebuilt by
    an elastic restore)."""
    self.ram = tuple(sorted(set(self.ram) | {int(s) for s in steps}))

  def forget(self, step: int) -> None:
    """`step` was deleted from both tiers."""
    self.ram = tuple(s for s in self.ram if s != step)
    self.persistent = tuple(s for s in self.persistent if s != step)
    self.persistent_seen = tuple(s for s in self.persistent_seen if s != step)

  def keep_ram(self, keep: Callable[[int], bool]) -> None:
    """Drops the agreed RAM steps `keep` rejects (an abandoned timeline, a parent's
    retention)."""
    self.ram = tuple(s for s in self.ram if keep(s))

  # --------------------------------------------------------------------- faults

  def note_local_error(self, error: BaseException) -> bool:
    """Keeps an error of this process for the next agreement. Returns False when one is
    already kept (the caller logs the further one)."""
    return self._unreported.offer(error)

  def take_fault(self) -> agreement.Fault:
    """This process's unreported error, handed to the next agreement."""
    error = self._unreported.take()
    if error is not None:
      self._fault_cause = error
    return agreement.Fault.of(error)

  def forgive(self) -> None:
    """The agreed faults were handled without raising (a restore plans around them)."""
    self._fault_cause = None

  def raise_summary_faults(self, found: summary.Summary, what: str, *,
                           own_backup_error: BackupError | None = None) -> None:
    """Raises the same error on every process when any reported a fault (rule 9): a fault of
    its own on any process, else a failed backup (this process's own error, if it has one).

    Raises:
      agreement.CheckpointError: a local fault on any process.
      BackupError: else, a failed backup on any process.
    """
    cause, self._fault_cause = self._fault_cause, None
    if found.own_faults:
      self._before_local_raise()  # as in raise_answer_faults
      raise agreement.CheckpointError(found.named(what), found.error_origins()) from cause
    if found.backup_faults:
      if own_backup_error is not None:
        raise own_backup_error
      p, fault = min(found.faults.items())
      raise BackupError(fault.backup_step, RuntimeError(
          f"on process {p}: {fault.kind}: {fault.message}"))

  def raise_answer_faults(self, answer: save_census.SaveAnswer, what: str, *,
                          own_backup_error: BackupError | None = None) -> None:
    """As `raise_summary_faults`, from a census's answer: the lowest processes' messages
    travel, the others are counted (rule 9)."""
    cause, self._fault_cause = self._fault_cause, None
    if answer.local_count:
      # This error usually ends the program: let the backup in flight finish first (every
      # process is here), or the interpreter stops under it and leaves a half-written
      # `<step>.orbax-checkpoint-tmp` behind ("cannot schedule new futures after shutdown").
      self._before_local_raise()
      origins = {p: f"{f.kind}: {f.message}" for p, f in answer.local.items()}
      if answer.local_count > len(origins):
        what = f"{what} ({answer.local_count} processes; the lowest {len(origins)} named)"
      raise agreement.CheckpointError(what, origins) from cause
    if answer.backup is not None:
      if own_backup_error is not None:
        raise own_backup_error
      p, fault = answer.backup
      raise BackupError(fault.backup_step, RuntimeError(
          f"on process {p}: {fault.kind}: {fault.message}"))

  def agree_steps(self, what: str, *,
                  backup_error: Callable[[], BackupError | None] | None = None) -> None:
    """Agrees the step lists and raises, on every process alike, the errors any process
    still holds (collective).

    Args:
      what: the call, for errors and timeouts.
      backup_error: hands over a failed newest backup, reported when no local fault is.
    """
    fault = self.take_fault()
    failed_backup = None
    if backup_error is not None and not fault.present:
      failed_backup = backup_error()
      if failed_backup is not None:
        fault = agreement.Fault.of(failed_backup.cause, backup_step=failed_backup.step)
    # The census of a save, without a step (save_census: its size does not grow with the
    # cluster); the step lists agreed so far seed its slots.
    record = agreement.SaveRecord(step=-1, fault=fault, inventory=self.inventory())
    answer = save_census.agree(
        record, self.process_index, self.process_count, self._listing_groups(),
        [*self.ram, *self.persistent_seen], self._persistent_steps(),
        lambda rnd: self._listing_reduce(rnd, what))
    self.adopt_answer(answer)
    self.raise_answer_faults(answer, what, own_backup_error=failed_backup)
