"""MaxText's checkpoint item names, and which managers are orbax-mtc's multi-tier form.

The names are those MaxText's own checkpointing uses (0.2.0 to 0.2.5 alike). `is_multi_tier`
tells a multi-tier manager (items `state` and `iter`) from a one-tier one (item `items`).
"""

from __future__ import annotations

from typing import Any

import orbax_mtc as mtc

_STATE_ITEM = "state"  # MaxText's item name for the emergency managers
_ITEMS = "items"  # MaxText's item name for its standard manager
_ITER = "iter"  # MaxText's item name for the grain data iterator (0.2.0 to 0.2.5 alike)
_GRAIN = "grain"  # the dataset_type whose iterator MaxText checkpoints


def is_multi_tier(checkpoint_manager: Any) -> bool:
  """Whether a manager is an orbax-mtc manager in its multi-tier form.

  Args:
    checkpoint_manager: Any object (a manager or None).

  Returns:
    True for a multi-tier `orbax_mtc.CheckpointManager` (built by the factories in `managers`); False
    for a plain or parent-style Orbax manager, or anything else.
  """
  return isinstance(checkpoint_manager, mtc.CheckpointManager) and isinstance(
      checkpoint_manager.options, mtc.CheckpointManagerOptions)
