"""Pure restore planning: which step the cluster restores and from which tier.

Inputs are inventories gathered from every process; no I/O and no JAX here, so every case can
be tested exhaustively.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

LOCAL = "local"
PERSISTENT = "persistent"
NONE = "none"

# Width of the per-process inventory row exchanged with one all-gather. Retention keeps far
# fewer local steps than this; older steps beyond it are simply not candidates.
INVENTORY_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Candidates in the order they are tried: local steps newest first, then persistent."""

  local_candidates: tuple[int, ...]
  persistent_step: int | None

  @property
  def empty(self) -> bool:
    return not self.local_candidates and self.persistent_step is None


def encode_inventory(steps: Sequence[int], width: int = INVENTORY_WIDTH) -> np.ndarray:
  """The newest `width` steps, newest first, padded with -1: one fixed-size row per process."""
  newest = sorted(set(int(s) for s in steps), reverse=True)[:width]
  row = np.full((width,), -1, dtype=np.int64)
  row[: len(newest)] = newest
  return row


def decode_inventories(rows: np.ndarray) -> list[set[int]]:
  rows = np.asarray(rows).reshape(-1, np.asarray(rows).shape[-1])
  return [set(int(s) for s in row if s >= 0) for row in rows]


def common_steps(inventories: Sequence[set[int]]) -> list[int]:
  """Steps that every process holds, newest first."""
  if not inventories:
    return []
  shared = set.intersection(*map(set, inventories))
  return sorted(shared, reverse=True)


def plan_restore(inventories: Sequence[set[int]], persistent_steps: Sequence[int],
                 requested_step: int | None) -> RestorePlan:
  """Local candidates every process holds (newest first) and the persistent fallback.

  With `requested_step`, only that step is a candidate in either tier.
  """
  local = common_steps(inventories)
  persistent = sorted(set(int(s) for s in persistent_steps))
  if requested_step is not None:
    local = [s for s in local if s == requested_step]
    persistent = [s for s in persistent if s == requested_step]
  persistent_step = persistent[-1] if persistent else None
  # A local step older than the newest persistent step would lose work: persistent wins then.
  if persistent_step is not None:
    local = [s for s in local if s >= persistent_step]
  return RestorePlan(local_candidates=tuple(local), persistent_step=persistent_step)
