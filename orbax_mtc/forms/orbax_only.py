"""The parent-style form without a RAM tier: exactly Orbax's manager on `directory`."""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp

from orbax_mtc.persistent.tier import PersistentTier


class OrbaxOnlyForm:
  """Orbax's `CheckpointManager`, called as is; the RAM tier's reports stay empty.

  Args:
    orbax: the Orbax manager on `directory`.
  """

  # What a manager with a RAM tier reports, for one without.
  local_directory = None
  global_mesh = None
  replica_axis = None
  topology = None
  last_restore = None
  last_ondemand = None
  last_save_blocking_seconds = None
  last_backup = None
  pending_backup = None
  backup_history = ()
  backup_waits = None
  in_primary_slice = True
  last_replication_bytes = 0

  def __init__(self, orbax: ocp.CheckpointManager):
    self.persistent = PersistentTier(orbax)
    self.orbax = orbax

  @property
  def directory(self) -> Any:
    return self.orbax.directory

  @property
  def user_options(self) -> ocp.CheckpointManagerOptions:
    return self.persistent.orbax_options

  def should_exit(self) -> bool:
    return False  # Orbax's manager asks JAX's sync point; training loops ask it too

  def wait_until_local_finished(self) -> None:
    """Nothing of ours is in flight without a RAM tier."""

  def replicate_pending(self) -> None:
    """No RAM tier, no peer copies."""

  # Orbax's own methods, called as they are.

  def reached_preemption(self, step: int) -> bool:
    return self.orbax.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    return self.orbax.should_save(step)

  def save(self, step: int, **kwargs: Any) -> bool:
    return self.orbax.save(step, **kwargs)

  def restore(self, step: int | None, **kwargs: Any) -> Any:
    return self.orbax.restore(step, **kwargs)

  def all_steps(self, read: bool = False) -> list[int]:
    return list(self.orbax.all_steps(read))

  def latest_step(self) -> int | None:
    return self.orbax.latest_step()

  def best_step(self) -> int | None:
    return self.orbax.best_step()

  def metrics(self, step: int) -> Any:
    return self.orbax.metrics(step)

  def reload(self) -> None:
    self.orbax.reload()

  def delete(self, step: int) -> None:
    self.orbax.delete(step)

  def item_metadata(self, step: int) -> Any:
    return self.orbax.item_metadata(step)

  def metadata(self, step: int | None) -> Any:
    return self.orbax.metadata(step)

  def is_saving_in_progress(self) -> bool:
    return self.orbax.is_saving_in_progress()

  def wait_until_finished(self) -> None:
    self.orbax.wait_until_finished()

  def check_for_errors(self) -> None:
    self.orbax.check_for_errors()

  def close(self) -> None:
    self.orbax.close()
