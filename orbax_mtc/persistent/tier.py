"""The persistent tier: a plain Orbax `CheckpointManager` on the persistent directory.

The tier owns that manager and is only called: it never calls back into ours. Everything
it needs from the other parts comes in as arguments (the agreed persistent steps, the agreed
preemption answer, whether a backup is in progress). With this package's `orbax_internals`,
it is the one place that reads Orbax's internals (the finalize thread, the save policy's
history, the preservation policy); another Orbax version without them falls back to the
public flags.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc import agreement
from orbax_mtc.persistent import orbax_internals
from orbax_mtc.summary import Summary


class AgreedPreemptionManager(ocp.CheckpointManager):
  """Orbax's manager, told the preemption step instead of asking JAX's sync point.

  The multi-tier form agrees the step every process saves on after a SIGTERM itself
  (preemption.py); Orbax's save and finalize ask `reached_preemption(step)` for their logs
  and metrics, and must hear that answer. Everything else is Orbax's, unchanged.
  """

  def __init__(self, *args: Any, **kwargs: Any):
    self.preemption_step: int | None = None  # set by PersistentTier.note_preemption
    super().__init__(*args, **kwargs)

  def reached_preemption(self, step: int) -> bool:
    return self.preemption_step is not None and step == self.preemption_step


class PersistentTier:
  """The persistent tier's operations on its Orbax manager.

  Args:
    orbax_manager: the Orbax manager on the persistent directory (this tier owns it).
  """

  def __init__(self, orbax_manager: ocp.CheckpointManager):
    self.orbax = orbax_manager

  @property
  def directory(self) -> epath.Path:
    return self.orbax.directory

  @property
  def orbax_options(self) -> ocp.CheckpointManagerOptions:
    """The Orbax manager's options, as it completed them."""
    return self.orbax._options

  def note_preemption(self, step: int) -> None:
    """The agreed preemption step (Orbax's own logs and metrics then name it)."""
    if isinstance(self.orbax, AgreedPreemptionManager):
      self.orbax.preemption_step = step

  # ----------------------------------------------------------------- steps and metadata

  def steps(self, read: bool = False) -> list[int]:
    """The persistent steps this process sees, as Python ints (Orbax's single-host load and
    broadcast hands numpy integers around)."""
    return [int(step) for step in self.orbax.all_steps(read)]

  def reload(self) -> None:
    self.orbax.reload()

  def metadata(self, step: int | None = None) -> Any:
    return self.orbax.metadata(step)

  def item_metadata(self, step: int) -> Any:
    return self.orbax.item_metadata(step)

  def metrics(self, step: int) -> Any:
    return self.orbax.metrics(step)

  def tracks_best(self) -> bool:
    """Whether Orbax ranks the steps by metrics (a `best_fn`)."""
    return bool(self.orbax._track_best)

  def best_step(self) -> int | None:
    return self.orbax.best_step()

  def commit_time(self, step: int) -> float | None:
    """Seconds since the epoch at which `step` was committed, if Orbax recorded it."""
    nsecs = self.orbax.metadata(step).commit_timestamp_nsecs
    return nsecs / 1e9 if nsecs else None

  def step_directory(self, step: int) -> epath.Path:
    """Where `step` is read from."""
    return epath.Path(self.orbax._get_read_step_directory(step, self.orbax.directory))

  def default_item_mode(self) -> bool | None:
    """Orbax's single-item mode, once a save or restore fixed it (None before)."""
    return self.orbax._default_item.get()

  def fix_default_item_mode(self, single: bool) -> None:
    """Fixes Orbax's single-item mode, as its own restore would have (a restore from RAM)."""
    self.orbax._default_item.set_if_none(single)

  # ----------------------------------------------------------------- save, restore, delete

  def save(self, step: int, args: Any, metrics: Any,
           custom_metadata: dict[str, Any] | None) -> None:
    """Orbax's save of `step` (forced; Orbax writes in the background)."""
    self.orbax.save(step, args=args, metrics=metrics, force=True,
                    custom_metadata=custom_metadata)

  def restore(self, step: int | None, args: Any, directory: epath.PathLike | None = None) -> Any:
    return self.orbax.restore(step, args=args, directory=directory)

  def delete(self, step: int, summarize: Callable[[Any, str], Summary]) -> None:
    """Orbax's delete of `step` (collective), entered by every process or by none.

    A process whose view of the persistent directory lags (a failed finalize) re-reads it
    first; then one agreement says whether every process sees the step, since Orbax's
    delete raises on a process that does not and waits in a barrier on the others.

    Raises:
      CheckpointError: some process does not see `step` even after re-reading (on every
        process alike; nothing was deleted).
    """
    error = agreement.Fault()
    try:
      if step not in self.steps():
        self.orbax.reload()
      if step not in self.steps():
        error = agreement.Fault("FileNotFoundError",
                                f"step {step} is not in its view of {self.directory}")
    except Exception as e:  # noqa: BLE001 - agreed below: raised on every process alike
      error = agreement.Fault.of(e)
    found = summarize(agreement.OutcomeRecord(fault=error), f"delete({step})")
    if found.own_faults:
      raise agreement.CheckpointError(found.named(
          f"delete({step}) of the persistent step (some processes cannot see it; is "
          f"{self.directory} shared by every host?)"), found.error_origins())
    self.orbax.delete(step)

  # ----------------------------------------------------------------- background work

  def wait(self) -> None:
    """Orbax's `wait_until_finished` (raises a background failure, once)."""
    self.orbax.wait_until_finished()

  def check_for_errors(self) -> None:
    self.orbax.check_for_errors()

  def close(self) -> None:
    self.orbax.close()

  def finalizing(self) -> bool:
    """Whether Orbax's finalize thread of the newest save still runs on this process.

    Asked of the thread, not of `is_saving_in_progress()`: that flag is cleared through a
    barrier (with Orbax's timeout) on the finalize thread, and when a process's finalize
    comes late (a hung write) the barrier times out and the flag stays True for good, which
    would stop every later backup. Another Orbax version without the thread falls back to
    the flag.
    """
    finalize = self.orbax.__dict__.get("_finalize_thread")
    if finalize is None or not hasattr(finalize, "map"):
      return bool(self.orbax.is_saving_in_progress())
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
    return self.finalizing() or orbax_internals.orbax_writes_running(self.orbax._checkpointer)

  def leftover_errors(self) -> list[BaseException]:
    """Waits for Orbax's earlier saves and consumes the errors they left on this process."""
    errors: list[BaseException] = []
    try:
      self.wait()
    except Exception as e:  # noqa: BLE001 - reported by the caller
      errors.append(e)
    return errors + orbax_internals.collect_orbax_errors(self.orbax._checkpointer)

  # ----------------------------------------------------------------- Orbax's policies

  def retention_drops(self, step: int, metrics: Any) -> bool:
    """Whether Orbax's preservation policy removes `step` (saved with `metrics`) as soon as
    it is saved (Orbax keeps no step the policy does not preserve, the newest included)."""
    policy = self.orbax.__dict__.get("_preservation_policy")
    if policy is None:
      return False
    infos = [info for info in self.orbax._checkpoints if info.step < step]
    current = ocp.checkpoint_manager.CheckpointInfo(
        step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=metrics)
    flags = policy.should_preserve([*infos, current], context=policies.PreservationContext())
    return not flags[-1]

  def policy_says(self, step: int, agreed: Sequence[int], *, preempted: bool,
                  saving: bool) -> bool:
    """Orbax's `should_save` for the persistent tier, asked with the agreed persistent steps
    instead of this process's own list (which can lag after a failed finalize), the agreed
    preemption answer, and `saving` (a backup chosen or still written) as Orbax's "saving in
    progress": a `ContinuousCheckpointingPolicy` then waits for it, deciding on the primary
    alone."""
    if agreed and agreed[-1] >= step:
      return False
    kept = set(agreed)
    orbax = self.orbax
    previous = [info for info in orbax._checkpoints if info.step in kept]
    context = policies.DecisionContext(
        is_saving_in_progress=saving, reached_preemption=preempted,
        multiprocessing_options=orbax._multiprocessing_options)
    current = ocp.checkpoint_manager.CheckpointInfo(
        step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=None)
    return bool(orbax._save_decision_policy.should_save(current, previous_steps=previous,
                                                        context=context))
