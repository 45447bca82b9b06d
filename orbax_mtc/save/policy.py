"""When each tier saves: pure decisions in the style of Orbax's `SaveDecisionPolicy`.

Every input here is agreed (rule 8 of docs/design.md): the step lists every process agreed
on, the preemption answer, the caller's `force`. So every process takes the same branch, and
these functions can be tested with plain numbers (no JAX, no I/O, no collective).

- `ShouldSaveFnPolicy` wraps Orbax's older `should_save_fn(step, last_saved_step)` as a policy.
- `ram_policy` is the RAM tier's policy from `LocalCheckpointOptions`.
- `ram_should_save` asks it with the agreed RAM steps.
- `first_backup_due` counts the first backup from an attempt that may still be on its way.
- `decide_save` turns one `save(step)` call into a `SaveDecision`.
- `SaveCost` and `held_until` space RAM saves by what they cost the loop
  (`LocalCheckpointOptions.save_overhead_budget`).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint import options as ocp_options
from orbax.checkpoint.checkpoint_manager import CheckpointInfo


def checked_step(step: Any) -> int:
  """`step` as an int; ValueError unless it is a non-negative integer."""
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}.")
  return int(step)


def step_info(step: int, seconds: float, metrics: Any = None) -> CheckpointInfo:
  """Orbax's `CheckpointInfo` of a RAM step saved at `seconds` since the epoch, as its
  policies read it."""
  return CheckpointInfo(step=step, time=datetime.datetime.fromtimestamp(seconds,
                                                                         tz=datetime.UTC),
                        metrics=metrics)


@dataclasses.dataclass(frozen=True)
class ShouldSaveFnPolicy:
  """Orbax's `should_save_fn(step, last_saved_step) -> bool` as a `SaveDecisionPolicy`."""

  fn: Callable[[int, int | None], bool]

  def should_save(self, step: policies.PolicyCheckpointInfo,
                  previous_steps: Sequence[policies.PolicyCheckpointInfo], *,
                  context: policies.DecisionContext) -> bool:
    del context
    last = previous_steps[-1].step if previous_steps else None
    return bool(self.fn(step.step, last))


def ram_policy(local_options: Any) -> policies.SaveDecisionPolicy:
  """The RAM tier's save policy.

  Args:
    local_options: `LocalCheckpointOptions`.

  Returns:
    Its `save_decision_policy`, else its `should_save_fn` as a policy, else every
    `save_interval_steps` steps.
  """
  if local_options.save_decision_policy is not None:
    return local_options.save_decision_policy
  if local_options.should_save_fn is not None:
    return ShouldSaveFnPolicy(local_options.should_save_fn)
  return policies.FixedIntervalPolicy(local_options.save_interval_steps)


def ram_should_save(step: int, agreed_ram: Sequence[int], local_options: Any, *,
                    write_in_flight: bool, now: float = 0.0,
                    saved_at: Callable[[int], float] = lambda step: 0.0,
                    held_until: int | None = None) -> bool:
  """Whether the RAM tier saves `step`.

  Args:
    step: the step asked about.
    agreed_ram: the RAM steps every process agreed on (the step being written among them),
      so that a node whose folder was wiped answers as the others do.
    local_options: `LocalCheckpointOptions`.
    write_in_flight: a local write is still running (Orbax's "saving in progress": a
      `ContinuousCheckpointingPolicy` waits for it, deciding on the primary alone).
    now: the current time, seconds since the epoch.
    saved_at: when a RAM step was saved, seconds since the epoch.
    held_until: the agreed first step the policy is asked about after the newest save
      (`save_overhead_budget`); earlier steps are not saved and the policy is not asked.

  Returns:
    False when read-only, held, or when a step at least as new is held; else the policy's
    answer.
  """
  if local_options.read_only or (held_until is not None and step < held_until):
    return False
  steps = sorted(agreed_ram)
  if steps and steps[-1] >= step:
    return False
  context = policies.DecisionContext(
      is_saving_in_progress=write_in_flight, reached_preemption=False,
      multiprocessing_options=ocp_options.MultiprocessingOptions())
  return bool(ram_policy(local_options).should_save(
      step_info(step, now), [step_info(s, saved_at(s)) for s in steps],
      context=context))


def first_backup_due(step: int, last_attempt_step: int, persistent_options: Any) -> bool:
  """Whether `step` is due for backup while the first backup (of `last_attempt_step`) may be
  on its way: Orbax would save the first step it is asked about, so count from the attempt.

  Args:
    step: the step asked about.
    last_attempt_step: the step of the newest backup attempt.
    persistent_options: `PersistentCheckpointOptions` (without a `save_decision_policy`).
  """
  if persistent_options.should_save_fn is not None:
    return bool(persistent_options.should_save_fn(step, last_attempt_step))
  return step > last_attempt_step and step % persistent_options.save_interval_steps == 0


class SaveAction(enum.Enum):
  """What one `save(step)` call does."""

  SKIP = "skip"  # no tier is due (or the on-demand step was saved already)
  ONDEMAND = "ondemand"  # the preemption step: RAM, peers, then persistent within the budget
  OLDER_STEP = "older_step"  # forced, older than the newest RAM step: persistent tier only
  LOCAL = "local"  # the RAM tier (and, when `backup` is set, a backup taken from it)
  PERSISTENT_ONLY = "persistent_only"  # read-only RAM tier: back up straight from the arrays


@dataclasses.dataclass(frozen=True)
class SaveDecision:
  """The outcome of `decide_save`: the action, and whether a backup is wanted with it."""

  action: SaveAction
  backup: bool = False


def decide_save(step: int, *, force: bool, preempted: bool, read_only: bool, managed: bool,
                agreed_ram: Sequence[int], agreed_persistent: Sequence[int],
                ondemand_step: int | None, ram_due: Callable[[], bool],
                persistent_due: Callable[[], bool]) -> SaveDecision:
  """Decides one `save(step)` from agreed inputs (the same answer on every process).

  Args:
    step: the step being saved.
    force: the caller's `force`.
    preempted: `reached_preemption(step)`.
    read_only: the RAM tier is read-only.
    managed: GKE's replicator backs the RAM steps up (no persistent saves of ours).
    agreed_ram: the RAM steps every process agreed on.
    agreed_persistent: the persistent steps every process sees.
    ondemand_step: the step of the last on-demand save, if any.
    ram_due: the RAM tier's schedule (asked only when nothing else decides).
    persistent_due: the persistent tier's schedule (asked only when nothing else decides).

  Returns:
    The SaveDecision.
  """
  backup = not managed and (force or preempted or persistent_due()) and (
      step not in agreed_persistent)
  # A backup is taken from the RAM tier, so a step due for one is saved there too.
  local = not read_only and (force or preempted or backup or ram_due())
  if preempted:
    if ondemand_step == step:
      return SaveDecision(SaveAction.SKIP)  # saved on demand already (a step is saved once)
    return SaveDecision(SaveAction.ONDEMAND)
  if not (local or backup):
    return SaveDecision(SaveAction.SKIP)
  newest_ram = max(agreed_ram) if agreed_ram else None
  if local and newest_ram is not None and step < newest_ram:
    return SaveDecision(SaveAction.OLDER_STEP, backup=True)
  if local:
    return SaveDecision(SaveAction.LOCAL, backup=backup)
  return SaveDecision(SaveAction.PERSISTENT_ONLY, backup=True)


@dataclasses.dataclass
class SaveCost:
  """The loop time each RAM save costs (times passed in).

  A cycle runs from one RAM save's call to the next. Its cost is the time of its calls
  above the cheapest call between its saves (what a call costs with nothing of a save to
  do: its saving call, and the calls that moved its copies or agreed their outcome), plus
  how much longer than their median the loop's steps between its calls took (the update
  slowed by the save's background work beside it), each at most one median more: a longer
  pause is the loop's own (an evaluation, a data stall), not the save's.

  Attributes:
    budget: `LocalCheckpointOptions.save_overhead_budget` (None: no budget).
    began: When the newest RAM save's call began (None before the first).
    spent: Seconds inside this cycle's calls so far.
    calls: This cycle's calls so far.
    cheapest: The cheapest of them after the saving call (inf: none yet).
    outside: The loop's time between this cycle's calls so far.
    ended: When the last call returned (None before any).
  """

  budget: float | None
  began: float | None = None
  spent: float = 0.0
  calls: int = 0
  cheapest: float = math.inf
  outside: list[float] = dataclasses.field(default_factory=list)
  ended: float | None = None

  def begin(self, started: float) -> tuple[float, float] | None:
    """A RAM save's call began at `started`: closes the cycle before it and starts its own.
    Returns the closed cycle's (cost, seconds per call), or None if there was none."""
    closed = None
    if self.began is not None and self.calls:
      if self.ended is not None:
        self.outside.append(started - self.ended)  # the step before this save: its cycle's
      base = self.cheapest if self.calls > 1 else 0.0
      closed = (max(0.0, self.spent - (self.calls - 1) * base) + slowed(self.outside),
                (started - self.began) / self.calls)
    self.began, self.spent, self.calls, self.cheapest = started, 0.0, 0, math.inf
    self.outside = []
    return closed

  def add(self, started: float, ended: float) -> None:
    """One `save()` call from `started` to `ended` (nothing before the first RAM save)."""
    if self.began is not None:
      if self.calls:
        self.cheapest = min(self.cheapest, ended - started)
        if self.ended is not None:
          self.outside.append(started - self.ended)
      self.spent += ended - started
      self.calls += 1
    self.ended = ended


def slowed(outside: Sequence[float]) -> float:
  """How much longer than their median the loop's steps `outside` took, each counted at
  most one median (0 for fewer than 3 steps: no median to speak of)."""
  if len(outside) < 3:
    return 0.0
  median = float(np.median(outside))
  return float(sum(min(max(0.0, step - median), median) for step in outside))


def held_until(step: int, cost_s: float, call_s: float, budget: float) -> int:
  """The first step after RAM save `step` at which the RAM policy is asked again, so that a
  cycle costing `cost_s` of loop time spans at least `cost_s / budget` seconds of calls
  `call_s` apart (pure: agreed inputs give the same step on every process).

  Args:
    step: The step just saved to RAM.
    cost_s: The previous cycle's cost (the most any process reports).
    call_s: Seconds between two `save()` calls (the least any process reports); 0 when not
      known yet (no hold).
    budget: The fraction of the loop's time saves may take.
  """
  if call_s <= 0 or cost_s <= 0:
    return step + 1
  return step + max(1, math.ceil(cost_s / (budget * call_s)))


@dataclasses.dataclass(frozen=True)
class AgreedState:
  """What the schedule decides from, read once per call (agreed on every process but for
  `write_in_flight`, which only a continuous policy asks, on its primary alone)."""

  ram: tuple[int, ...] = ()  # the RAM steps every process agreed on
  persistent: tuple[int, ...] = ()  # the persistent steps every process sees
  preempted: bool = False  # the agreed preemption answer for this step
  write_in_flight: bool = False  # a RAM write still runs
  held_until: int | None = None  # no RAM save before this step (save_overhead_budget)
  backup_in_progress: bool = False  # a backup chosen or still written
  last_backup_attempt: int | None = None  # the newest backup attempt's step


class SaveSchedule:
  """The policies above, asked with an `AgreedState`.

  Args:
    options: the manager's `CheckpointManagerOptions`.
    managed: GKE's replicator backs the RAM tier up.
    backup_by_minutes: backups are decided by minutes, at RAM saves (not per step).
    saved_at: when a RAM step was saved (seconds since the epoch).
    persistent_policy: Orbax's own persistent policy, `persistent_policy(step, agreed
      persistent steps, preempted=..., saving=...)` (PersistentTier.policy_says).
  """

  def __init__(self, options: Any, *, managed: bool, backup_by_minutes: bool,
               saved_at: Callable[[int], float] = lambda step: 0.0,
               persistent_policy: Callable[..., bool]):
    self._options = options
    self._managed = managed
    self._saved_at = saved_at
    self._backup_by_minutes = backup_by_minutes
    self._persistent_policy = persistent_policy

  def ram_due(self, step: int, state: AgreedState) -> bool:
    """Whether the RAM tier's schedule asks for `step`."""
    return ram_should_save(step, state.ram, self._options.local,
                           write_in_flight=state.write_in_flight, now=time.time(),
                           saved_at=self._saved_at, held_until=state.held_until)

  def persistent_due(self, step: int, state: AgreedState) -> bool:
    """Whether the persistent tier's schedule asks for `step`."""
    if self._managed or self._backup_by_minutes:
      return False  # GKE's replicator backs up; by minutes: decided at RAM saves
    schedule = self._options.persistent
    attempt = state.last_backup_attempt
    if attempt is not None and schedule.save_decision_policy is None and not state.persistent:
      return first_backup_due(step, attempt, schedule)
    return self._persistent_policy(step, state.persistent, preempted=state.preempted,
                                   saving=state.backup_in_progress)

  def should_save(self, step: int, state: AgreedState) -> bool:
    """`should_save(step)`: the preemption step, or a tier's schedule."""
    return state.preempted or self.ram_due(step, state) or self.persistent_due(step, state)

  def decide(self, step: int, state: AgreedState, *, force: bool,
             ondemand_step: int | None) -> SaveDecision:
    """`decide_save` for one `save(step)` call."""
    return decide_save(
        step, force=force, preempted=state.preempted, read_only=self._options.local.read_only,
        managed=self._managed, agreed_ram=state.ram, agreed_persistent=state.persistent,
        ondemand_step=ondemand_step, ram_due=lambda: self.ram_due(step, state),
        persistent_due=lambda: self.persistent_due(step, state))
