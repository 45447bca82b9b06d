"""Which RAM steps each node keeps (pure): the newest `max_to_keep`, or, for an Orbax
`PreservationPolicy` other than `LatestN`, the steps the policy preserves, asked with each
step's save time and metrics. The newest step and the floor every node holds are always kept
(a restore needs them). The same answer feeds the agreed step lists (`ledger`), the RAM
folders (`local.store`) and the peer copies (`peers.copy_store`), so they never disagree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc.save.policy import step_info


class RamRetention:
  """The RAM tier's retention.

  Args:
    max_to_keep: the newest steps kept, when no policy is given (None keeps all).
    policy: an Orbax `PreservationPolicy`, or None.

  The RAM saver records each step's agreed save time and metrics here (`record`), which the
  policy reads.
  """

  def __init__(self, max_to_keep: int | None, policy: Any = None):
    self.max_to_keep = max_to_keep
    self.policy = policy
    self._saved_at: dict[int, float] = {}  # RAM step -> the agreed clock when it was saved
    self._metrics: dict[int, Any] = {}  # RAM step -> the metrics it was saved with

  def record(self, step: int, seconds: float, metrics: Any) -> None:
    """`step` was saved at `seconds` (the agreed clock) with `metrics`."""
    self._saved_at[step] = seconds
    self._metrics[step] = metrics

  def forget_others(self, held: Collection[int]) -> None:
    """Drops the records of steps no longer `held`."""
    self._saved_at = {s: t for s, t in self._saved_at.items() if s in held}
    self._metrics = {s: m for s, m in self._metrics.items() if s in held}

  def saved_at(self, step: int) -> float:
    """When RAM step `step` was saved, seconds since the epoch: the agreed clock of its
    save, the same on every process; 0 (as old as can be) for a step of an earlier run,
    whose manifests' times differ between processes (retention must be one answer)."""
    return self._saved_at.get(step, 0.0)

  def metrics_of(self, step: int) -> Any:
    """The metrics RAM step `step` was saved with in this run (None otherwise)."""
    return self._metrics.get(step)

  def kept(self, steps: Collection[int], floor: int | None = None) -> set[int]:
    """The steps of `steps` kept (the newest and `floor` always among them)."""
    ordered = sorted(set(steps))
    if not ordered:
      return set()
    if self.policy is not None:
      infos = [step_info(s, self.saved_at(s), self.metrics_of(s)) for s in ordered]
      preserve = self.policy.should_preserve(infos, context=policies.PreservationContext())
      kept = {s for s, keep in zip(ordered, preserve, strict=True) if keep}
    elif self.max_to_keep is None:
      kept = set(ordered)
    else:
      kept = set(ordered[-self.max_to_keep:])
    kept.add(ordered[-1])
    if floor is not None and floor in ordered:
      kept.add(floor)
    return kept
