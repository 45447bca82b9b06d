"""The persistent tier: the parent `ocp.CheckpointManager`, seen from the composed parts.

`orbax_mtc.CheckpointManager` *is* an `ocp.CheckpointManager` constructed on the persistent
directory, so the persistent tier is a standard Orbax checkpoint written by Orbax's own code.
The composed parts (backup scheduler, persistent restore, on-demand save) reach it only
through a `PersistentTier`, which runs the parent's methods in the manager's "persistent
view" (inside it, the manager's own overrides defer to the parent). This module is also the
one place that reads Orbax's internals (the finalize thread, the save policy's history);
another Orbax version without them falls back to the public flags.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc import agreement, backup
from orbax_mtc.agreement import Status


def persistent_view_when_nested(method):
  """Runs the parent class's method instead while the parent runs inside one of ours.

  The parent's `save`/`restore`/`__init__` call `self.all_steps()`, `self.wait_until_finished()`
  and friends; inside those calls they must see the persistent tier alone. Before our
  `__init__` completes (the parent's runs first, partly on worker threads) there is only the
  parent too.
  """
  name = method.__name__

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    if not self.__dict__.get("_mtc_ready") or getattr(self._view, "persistent", False):
      return getattr(ocp.CheckpointManager, name)(self, *args, **kwargs)
    return method(self, *args, **kwargs)

  return wrapper


class PersistentTier:
  """The parent manager's persistent-tier operations.

  Args:
    orbax_manager: the manager, as the parent class knows it (for its attributes).
    parent: `parent(name)` returns the parent class's bound method `name`, run in the
      persistent view.
  """

  def __init__(self, orbax_manager: ocp.CheckpointManager,
               parent: Callable[[str], Callable[..., Any]]):
    self._manager = orbax_manager
    self._parent = parent

  @property
  def directory(self) -> epath.Path:
    return self._manager.directory

  def delete(self, step: int, agree: Callable[[Any, str], list[Any]]) -> None:
    """Orbax's delete of `step` (collective), entered by every process or by none.

    A process whose view of the persistent directory lags (a failed finalize) re-reads it
    first; then one agreement says whether every process sees the step, since Orbax's
    delete raises on a process that does not and waits in a barrier on the others.

    Raises:
      CheckpointError: some process does not see `step` even after re-reading (on every
        process alike; nothing was deleted).
    """
    try:
      if step not in self.steps():
        self._parent("reload")()
      sees = step in self.steps()
      message = "" if sees else (f"FileNotFoundError: step {step} is not in its view of "
                                 f"{self.directory}")
    except Exception as e:  # noqa: BLE001 - agreed below: raised on every process alike
      sees, message = False, f"{type(e).__name__}: {e}"
    records = agree(agreement.OutcomeRecord(status=Status.OK if sees else Status.FAILED,
                                            message=message), f"delete({step})")
    missing = {p: r.message for p, r in enumerate(records) if r.status != Status.OK}
    if missing:
      raise agreement.CheckpointError(
          f"delete({step}) of the persistent step (some processes cannot see it; is "
          f"{self.directory} shared by every host?)", missing)
    self._parent("delete")(step)

  def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    """The parent's method `name`, as Orbax defines it (persistent tier alone)."""
    return self._parent(name)(*args, **kwargs)

  def steps(self) -> list[int]:
    """The persistent steps this process sees."""
    return list(self._parent("all_steps")())

  def save(self, step: int, args: Any, metrics: Any,
           custom_metadata: dict[str, Any] | None) -> None:
    """Orbax's save of `step` (forced; Orbax writes in the background)."""
    self._parent("save")(step, args=args, metrics=metrics, force=True,
                         custom_metadata=custom_metadata)

  def wait(self) -> None:
    """Orbax's `wait_until_finished` (raises a background failure, once)."""
    self._parent("wait_until_finished")()

  def commit_time(self, step: int) -> float | None:
    """Seconds since the epoch at which `step` was committed, if Orbax recorded it."""
    nsecs = self._parent("metadata")(step).commit_timestamp_nsecs
    return nsecs / 1e9 if nsecs else None

  def step_directory(self, step: int) -> epath.Path:
    """Where `step` is read from."""
    return epath.Path(self._manager._get_read_step_directory(step, self._manager.directory))

  def finalizing(self) -> bool:
    """Whether Orbax's finalize thread of the newest save still runs on this process.

    Asked of the thread, not of the parent's `is_saving_in_progress()`: that flag is cleared
    through a barrier (with Orbax's timeout) on the finalize thread, and when a process's
    finalize comes late (a hung write) the barrier times out and the flag stays True for
    good, which would stop every later backup. Another Orbax version without the thread
    falls back to the flag.
    """
    finalize = self._manager.__dict__.get("_finalize_thread")
    if finalize is None or not hasattr(finalize, "map"):
      return bool(self._parent("is_saving_in_progress")())
    return bool(finalize.map(lambda thread: thread is not None and thread.is_alive()))

  def wait_idle(self, timeout_s: float) -> bool:
    """Waits until Orbax no longer works on a save here (`busy`), at most `timeout_s`;
    returns whether it is idle."""
    deadline = time.monotonic() + timeout_s
    while self.busy():
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.01)  # Orbax's threads give nothing to wait on for all three
    return True

  def busy(self) -> bool:
    """Whether Orbax still works on a save on this process (finalize thread, commit thread,
    metadata file write): a save started now would wait for it on the main thread."""
    return self.finalizing() or backup.orbax_writes_running(self._manager._checkpointer)

  def leftover_errors(self) -> list[BaseException]:
    """Waits for Orbax's earlier saves and consumes the errors they left on this process."""
    errors: list[BaseException] = []
    try:
      self.wait()
    except Exception as e:  # noqa: BLE001 - reported by the caller
      errors.append(e)
    return errors + backup.collect_orbax_errors(self._manager._checkpointer)

  def retention_drops(self, step: int, metrics: Any) -> bool:
    """Whether Orbax's preservation policy removes `step` (saved with `metrics`) as soon as
    it is saved (Orbax keeps no step the policy does not preserve, the newest included)."""
    policy = self._manager.__dict__.get("_preservation_policy")
    if policy is None:
      return False
    infos = [info for info in self._manager._checkpoints if info.step < step]
    current = ocp.checkpoint_manager.CheckpointInfo(
        step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=metrics)
    flags = policy.should_preserve([*infos, current], context=policies.PreservationContext())
    return not flags[-1]

  def policy_says(self, step: int, agreed: Sequence[int],
                  reached_preemption: Callable[[], bool], *,
                  saving: Callable[[], bool] = lambda: False) -> bool:
    """Orbax's `should_save` for the persistent tier, asked with the agreed persistent steps
    instead of this process's own list (which can lag after a failed finalize), and with
    `saving()` (a backup chosen or still written) as Orbax's "saving in progress": a
    `ContinuousCheckpointingPolicy` then waits for it, deciding on the primary alone."""
    if agreed and agreed[-1] >= step:
      return False
    kept = set(agreed)
    manager = self._manager
    previous = [info for info in manager._checkpoints if info.step in kept]
    context = policies.DecisionContext(
        is_saving_in_progress=saving(), reached_preemption=reached_preemption(),
        multiprocessing_options=manager._multiprocessing_options)
    current = ocp.checkpoint_manager.CheckpointInfo(
        step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=None)
    return bool(manager._save_decision_policy.should_save(current, previous_steps=previous,
                                                          context=context))
