"""Options of `orbax_mtc.ReplicatorCheckpointManager`: Orbax's replicator manager options."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint import path as ocp_path

from orbax_mtc.option_checks import check_bool, check_interval, warn_once


@dataclasses.dataclass
class ReplicatorCheckpointManagerOptions:
  """Options of `orbax_mtc.ReplicatorCheckpointManager`: Orbax's fields, defaults and order.

  Attributes:
    save_interval_steps: Save to the RAM tier every N steps (default 1).
    step_name_format: Names the steps of `persistent_directory` (the non-replicated items);
      the RAM tier's folders are always `<step>`, the replicator's layout (another format is
      warned about once).
    should_save_fn: `fn(step, last_saved_step) -> bool`; overrides `save_interval_steps`.
    preservation_policy: `LatestN(n)` keeps n RAM steps (other policies: warned once, the
      newest 1 is kept); `persistent_directory` applies any policy as Orbax does. None: the
      RAM tier keeps the newest 1 (Orbax keeps every local step and leaves the clean-up to
      the replicator).
    use_colocated_python: Pathways' colocated Python; not supported (True raises when the
      manager is built, as Orbax does outside Pathways).
    enable_async_checkpointing: RAM writes in the background.
    save_concurrent_gb: Orbax's tensorstore byte limit for saves; the RAM tier has none
      (warned once when set).
    restore_concurrent_gb: Orbax's tensorstore byte limit for restores; likewise not applied.

  Raises:
    ValueError: If `save_interval_steps` is not positive, or `save_concurrent_gb` /
      `restore_concurrent_gb` is not a positive int or None.
    TypeError: If `save_interval_steps` is not an int, `should_save_fn` is not callable, or
      `use_colocated_python` / `enable_async_checkpointing` is not a bool.
  """

  save_interval_steps: int = 1
  step_name_format: ocp_path.step.NameFormat | None = None
  should_save_fn: Callable[[int, int | None], bool] | None = None
  preservation_policy: policies.PreservationPolicy | None = None
  use_colocated_python: bool = False
  enable_async_checkpointing: bool = True
  save_concurrent_gb: int | None = None
  restore_concurrent_gb: int | None = None

  def __post_init__(self):
    owner = "ReplicatorCheckpointManagerOptions"
    check_interval(owner, "save_interval_steps", self.save_interval_steps, allow_none=False)
    if self.should_save_fn is not None and not callable(self.should_save_fn):
      raise TypeError(f"{owner}.should_save_fn must be callable.")
    for name in ("use_colocated_python", "enable_async_checkpointing"):
      check_bool(owner, name, getattr(self, name))
    if self.step_name_format is not None and self.step_name_format.build_name(7) != "7":
      warn_once(f"{owner}.step_name_format",
                "orbax-mtc: %s.step_name_format names the steps of persistent_directory only; "
                "RAM-tier step folders stay <step>, as the replicator reads them.", owner)
    for name in ("save_concurrent_gb", "restore_concurrent_gb"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int or None, got {value!r}.")
      warn_once(f"{owner}.{name}",
                "orbax-mtc: %s.%s=%d is not applied: the RAM tier writes and reads without a "
                "byte limit.", owner, name, value)
