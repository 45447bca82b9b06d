"""Which RAM steps each node keeps (pure): the newest `max_to_keep`, or, for an Orbax
`PreservationPolicy` other than `LatestN`, the steps the policy preserves, asked with each
step's save time and metrics. The newest step and the floor every node holds are always kept
(a restore needs them). The same answer feeds the agreed step lists (`ledger`), the RAM
folders (`local.store`) and the peer copies (`peers.store`), so they never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc.save_policy import step_info


class RamRetention:
  """The RAM tier's retention.

  Args:
    max_to_keep: the newest steps kept, when no policy is given (None keeps all).
    policy: an Orbax `PreservationPolicy`, or None.
    saved_at: when a RAM step was saved, seconds since the epoch.
    metrics: the metrics a RAM step was saved with, or None.
  """

  def __init__(self, max_to_keep: int | None, policy: Any = None, *,
               saved_at: Callable[[int], float] = lambda step: 0.0,
               metrics: Callable[[int], Any] = lambda step: None):
    self.max_to_keep = max_to_keep
    self.policy = policy
    self._saved_at = saved_at
    self._metrics = metrics

  def kept(self, steps: Collection[int], floor: int | None = None) -> set[int]:
    """The steps of `steps` kept (the newest and `floor` always among them)."""
    ordered = sorted(set(steps))
    if not ordered:
      return set()
    if self.policy is not None:
      infos = [step_info(s, self._saved_at(s), self._metrics(s)) for s in ordered]
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
