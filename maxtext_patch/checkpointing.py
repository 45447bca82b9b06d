"""MaxText's checkpointing functions, running on `orbax_mtc.CheckpointManager`.

Same names and signatures as MaxText's `maxtext.common.checkpointing` (MaxText 0.2.x) for the
paths a training loop takes: create a manager, `load_state_if_possible`,
`maybe_save_checkpoint` each step, `save_checkpoint`, `latest_step`, `wait_until_finished`,
`reached_preemption`, `print_save_message`; plus `create_checkpoint_manager(config, mesh,
init_state_fn)`, the counterpart of MaxText's `train_utils.create_checkpoint_manager`. A loop
of one's own can use them without MaxText. Under MaxText >= 0.2.4, `maxtext_patch.install()`
uses only the manager factories here (MaxText's own functions save and restore, in MaxText's
layout, see `set_state_layout`); older MaxText gets all of them.

How these functions differ from MaxText's:
- They hold the state as nested dicts keyed by field names (`_checkpoint_tree`): a Linen
  `TrainState` or an NNX state round-trips through it, and the persistent tier is a plain
  Orbax checkpoint with item `state` in the same layout.
- `load_state_if_possible` restores the newest step *every* process can assemble
  (`restore(None)`), never a step chosen from one process's view: after a node loss the new
  node has no step of its own and still takes part in the same restore.
- `maybe_save_checkpoint` asks `reached_preemption` at every step on every process, also where
  MaxText would return early: JAX's preemption sync point counts those calls.
- With `dataset_type=grain` a multi-tier step also holds each process's grain iterator
  position as item `iter` (MaxText's standard manager does that, its emergency managers do
  not); `install()` carries it to MaxText >= 0.2.4's own emergency save and restore
  (`carrying_iterator`, `with_carried_iterator`).

This module keeps the step loop's functions (restore, save, the preemption stop); the rest
lives in `items`, `state_tree`, `iterators` and `managers`, re-exported here under the same
names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

from maxtext_patch import config as mtc_config
from maxtext_patch import managers
from maxtext_patch.items import _ITEMS, _ITER, _STATE_ITEM, is_multi_tier
from maxtext_patch.iterators import (
  carrying_iterator,
  check_iterator_keys,
  checkpointed_iterator,
  iterator_restore_args,
  iterator_save_args,
  restore_with_iterator,
  with_carried_iterator,
)
from maxtext_patch.managers import (
  create_checkpoint_manager,
  create_orbax_checkpoint_manager,
  create_orbax_emergency_checkpoint_manager,
  create_orbax_emergency_replicator_checkpoint_manager,
  extra_keys,
  set_extra_keys,
  set_state_layout,
  using_config,
)
from maxtext_patch.state_tree import (
  _as_pytree,
  _checkpoint_tree,
  _from_checkpoint_tree,
  _state_step,
)

# MaxText's names, and the others install() and a loop of one's own use (most defined in the
# modules above, re-exported here).
__all__ = [
    "StopTraining",
    "carrying_iterator",
    "check_iterator_keys",
    "checkpointed_iterator",
    "create_checkpoint_manager",
    "create_orbax_checkpoint_manager",
    "create_orbax_emergency_checkpoint_manager",
    "create_orbax_emergency_replicator_checkpoint_manager",
    "extra_keys",
    "is_multi_tier",
    "iterator_restore_args",
    "iterator_save_args",
    "latest_step",
    "load_state_if_possible",
    "maybe_save_checkpoint",
    "print_save_message",
    "reached_preemption",
    "restore_with_iterator",
    "save_checkpoint",
    "set_extra_keys",
    "set_state_layout",
    "using_config",
    "wait_until_finished",
    "with_carried_iterator",
]


class StopTraining(Exception):
  """Ends the training loop cleanly (MaxText's `exceptions.StopTraining`).

  Raised at the agreed preemption step. Once `install()` ran, the exception raised is also
  MaxText's own class. A failed save is not a clean end: it raises RuntimeError, as MaxText
  does.

  Args:
    reason: Why training stops.
  """

  def __init__(self, reason: str):
    super().__init__(reason)


_stop_class: type[Exception] = StopTraining
# MaxText's loader for load_parameters_path / load_full_state_path (set by install()).
_fallback_loader: Callable[..., tuple[Any, Any]] | None = None


def _stop(reason: str) -> Exception:
  return _stop_class(reason)


def __getattr__(name: str) -> Any:
  """`_state_layout` and `_extra_keys`, read from `managers` at each access: their setters
  rebind them there, so an import here would keep the first value."""
  if name in ("_state_layout", "_extra_keys"):
    return getattr(managers, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ small functions


def print_save_message(step: int, async_checkpointing: bool) -> None:
  """Logs MaxText's message for a save.

  Args:
    step: The step saved.
    async_checkpointing: Whether the save runs in the background.
  """
  if async_checkpointing:
    logging.info("Started an asynchronous checkpoint save for step %d", step)
  else:
    logging.info("Saved a checkpoint at step %d.", step)


def latest_step(checkpoint_manager: Any) -> int | None:
  """Newest step this process sees (no collective; restore uses the agreed step instead).

  Args:
    checkpoint_manager: The manager.

  Returns:
    The newest step, or None if there is none.
  """
  return checkpoint_manager.latest_step()


def wait_until_finished(checkpoint_manager: Any) -> None:
  """Waits for the RAM write, peer copies and the backup in flight.

  Args:
    checkpoint_manager: The manager.
  """
  return checkpoint_manager.wait_until_finished()


def reached_preemption(checkpoint_manager: Any, step: int) -> bool:
  """Whether `step` is the step every process saves on after a SIGTERM (JAX's sync point).

  Args:
    checkpoint_manager: The manager.
    step: The current step.

  Returns:
    True at the agreed preemption step.
  """
  return checkpoint_manager.reached_preemption(step)


# ------------------------------------------------------------------ restore


def load_state_if_possible(
    checkpoint_manager: Any,
    data_iterator: Any,
    load_parameters_from_path: str,
    load_full_state_from_path: str,
    checkpoint_storage_concurrent_gb: int,
    abstract_unboxed_pre_state: Any,
    enable_single_replica_ckpt_restoring: bool | None = False,
    dataset_type: str | None = "tfds",
    step: int = -1,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    enable_orbax_v1: bool = False,
    checkpoint_conversion_fn: Any = None,
    source_checkpoint_layout: str = "orbax",
    expansion_factor_real_data: int = -1,
    maxtext_config: Any | None = None,
) -> tuple[Any, Any]:
  """Restores the training state as MaxText's function of the same name does.

  With an orbax-mtc manager: (restored state, None) as for MaxText's emergency managers, the
  state in the structure of `abstract_unboxed_pre_state`; `step=-1` is the newest step every
  process can assemble (RAM, a peer's copy, else persistent). With `dataset_type="grain"` the
  data iterator is set in place to the position saved with the step (item `iter`), as
  MaxText's standard manager does; a step saved without one leaves it at its start. Nothing
  there: the parameter or full-state paths, as MaxText (those need MaxText's loaders, i.e.
  `install()`).

  Args:
    checkpoint_manager: The manager, or None.
    data_iterator: MaxText's data iterator: restored in place for `dataset_type="grain"`.
    load_parameters_from_path: Parameters to load when there is no checkpoint.
    load_full_state_from_path: A full state to load when there is no checkpoint.
    checkpoint_storage_concurrent_gb: Passed to MaxText's loader.
    abstract_unboxed_pre_state: The train state's abstract form; the restore target.
    enable_single_replica_ckpt_restoring: Passed to MaxText's loader.
    dataset_type: "grain" restores the data iterator; also passed to MaxText's loader.
    step: The step to restore; -1 (or None) for the newest.
    use_ocdbt: Passed to MaxText's loader.
    use_zarr3: Passed to MaxText's loader.
    enable_orbax_v1: Passed to MaxText's loader.
    checkpoint_conversion_fn: Passed to MaxText's loader.
    source_checkpoint_layout: Passed to MaxText's loader.
    expansion_factor_real_data: Scaled loading (other than -1 or 1) is refused with
      `dataset_type="grain"`; also passed to MaxText's loader.
    maxtext_config: Passed to MaxText's loader.

  Returns:
    (full state, params) as MaxText returns them; at most one is not None, both None when
    there is nothing to restore.

  Raises:
    NotImplementedError: If a parameter or full-state path must be read but `install()` has
      not given MaxText's loader.
    MaxTextConfigError: If a grain iterator cannot be checkpointed (`checkpointed_iterator`).
    AbstractStateMismatchError: If the step does not match the state, or its iterator
      positions were saved by another process count.
  """
  kwargs = dict(
      checkpoint_manager=checkpoint_manager, data_iterator=data_iterator,
      load_parameters_from_path=load_parameters_from_path,
      load_full_state_from_path=load_full_state_from_path,
      checkpoint_storage_concurrent_gb=checkpoint_storage_concurrent_gb,
      abstract_unboxed_pre_state=abstract_unboxed_pre_state,
      enable_single_replica_ckpt_restoring=enable_single_replica_ckpt_restoring,
      dataset_type=dataset_type, step=step, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
      enable_orbax_v1=enable_orbax_v1, checkpoint_conversion_fn=checkpoint_conversion_fn,
      source_checkpoint_layout=source_checkpoint_layout,
      expansion_factor_real_data=expansion_factor_real_data, maxtext_config=maxtext_config)
  if checkpoint_manager is not None:
    if is_multi_tier(checkpoint_manager):
      wanted = None if step is None or step < 0 else step
      args = ocp.args.Composite(**{_STATE_ITEM: ocp.args.PyTreeRestore(
          item=_checkpoint_tree(abstract_unboxed_pre_state))})
      iterator = checkpointed_iterator(dataset_type, data_iterator, expansion_factor_real_data)
      if iterator is None:
        restored = checkpoint_manager.restore(wanted, args=args)
      else:
        restored = restore_with_iterator(checkpoint_manager, wanted, args, iterator)
      if restored is not None:
        info = checkpoint_manager.last_restore
        logging.info("maxtext_patch: restored step %s from the %s tier", info.step, info.tier)
        return _from_checkpoint_tree(restored[_STATE_ITEM], abstract_unboxed_pre_state), None
    else:
      found = checkpoint_manager.latest_step() if step is None or step < 0 else step
      if found is not None:
        restored = checkpoint_manager.restore(found, args=ocp.args.Composite(**{
            _ITEMS: ocp.args.PyTreeRestore(item=abstract_unboxed_pre_state)}))
        return restored, None
  kwargs["checkpoint_manager"] = None
  if load_parameters_from_path or load_full_state_from_path:
    if _fallback_loader is None:
      raise NotImplementedError(
          "load_parameters_path / load_full_state_path are read by MaxText's own loaders: run "
          "under MaxText with maxtext_patch.install().")
    return _fallback_loader(**kwargs)
  logging.info("maxtext_patch: no checkpoint to restore; starting from the initial state.")
  return None, None


# ------------------------------------------------------------------ save


def save_checkpoint(checkpoint_manager: Any, step: int, state: Any, config: Any = None,
                    data_iterator: Any = None, force: bool = False) -> bool:
  """Saves `state` as step `step` (the manager decides which tiers).

  With a multi-tier manager and `dataset_type=grain` in `config`, the step also holds this
  process's data iterator position as item `iter` (as MaxText's standard manager saves it), in
  every tier. The one-tier manager saves the state alone.

  Args:
    checkpoint_manager: The manager.
    step: The step number.
    state: The training state (a Linen TrainState, an NNX state or module, or a pytree).
    config: The MaxText config (its `dataset_type` and `expansion_factor_real_data`), or None.
    data_iterator: MaxText's data iterator: saved for `dataset_type=grain`.
    force: Save even off the save interval.

  Returns:
    True when the manager saved.

  Raises:
    MaxTextConfigError: If a grain iterator cannot be checkpointed (`checkpointed_iterator`).
  """
  if is_multi_tier(checkpoint_manager):
    tree = _checkpoint_tree(_as_pytree(state))
    items = {_STATE_ITEM: ocp.args.PyTreeSave(tree)}
    iterator = None if config is None else checkpointed_iterator(
        mtc_config.value_of(config, "dataset_type"), data_iterator,
        mtc_config.value_of(config, "expansion_factor_real_data"))
    if iterator is not None:
      items[_ITER] = iterator_save_args(iterator)
    args = ocp.args.Composite(**items)
  else:
    args = ocp.args.Composite(**{_ITEMS: ocp.args.PyTreeSave(state)})
  return bool(checkpoint_manager.save(step, args=args, force=force))


def _due(checkpoint_manager: Any, step: int, config: Any, force: bool) -> bool:
  """MaxText's rule: forced, or on the persistent or the RAM period, or the preemption step
  with enable_autocheckpoint."""
  if force:
    return True
  get = lambda key: mtc_config.value_of(config, key)  # noqa: E731
  if step == 0 and not mtc_config.as_bool("save_checkpoint_on_start",
                                        get("save_checkpoint_on_start")):
    return False
  if step % int(get("checkpoint_period")) == 0:
    return True
  if mtc_config.enabled_mode(config) is not None:
    local_period = int(get("local_checkpoint_period"))
    if local_period > 0 and step % local_period == 0:
      return True
  return mtc_config.as_bool("enable_autocheckpoint",
                          get("enable_autocheckpoint")) and \
      reached_preemption(checkpoint_manager, step)


def _after_save(checkpoint_manager: Any, step: int, force: bool) -> None:
  """Waits for a forced or on-demand save; ends training at the preemption step."""
  preempted = reached_preemption(checkpoint_manager, step)
  if force or preempted:
    wait_until_finished(checkpoint_manager)
  if preempted:
    raise _stop("Job received termination signal (SIGTERM).")


def maybe_save_checkpoint(checkpoint_manager: Any, state: Any, config: Any, data_iterator: Any,
                          step: int | None = None) -> None:
  """Called after every training step (and once more at the end with step=None).

  Saves when MaxText would (checkpoint_period, local_checkpoint_period, the agreed preemption
  step with enable_autocheckpoint, or the final step), and raises `StopTraining` after the
  preemption step once its save is durable.

  Args:
    checkpoint_manager: The manager, or None (then nothing happens).
    state: The training state.
    config: The MaxText config.
    data_iterator: MaxText's data iterator (saved with the step for `dataset_type=grain`).
    step: The step just trained; None at the end (the state's step - 1 is saved if due).

  Raises:
    StopTraining: At the agreed preemption step, once its save is durable.
    RuntimeError: If the save failed.
    ValueError: If `step` is None and the state has no step.
    MaxTextConfigError: If a config key is unusable.
  """
  if checkpoint_manager is None:
    return
  actual_step = int(step) if step is not None else _state_step(state) - 1
  period = int(mtc_config.value_of(config, "checkpoint_period"))
  force = step is None and actual_step != -1 and actual_step % period != 0
  if _due(checkpoint_manager, actual_step, config, force):
    if actual_step in checkpoint_manager.all_steps():
      logging.info("maxtext_patch: step %d is already saved; not saving it again.", actual_step)
    else:
      started = time.perf_counter()
      try:
        saved = save_checkpoint(checkpoint_manager, actual_step, state, config, data_iterator,
                                force)
      except Exception as e:  # noqa: BLE001 - a failed save ends the job as a failure
        raise RuntimeError(f"Checkpointing failed. {e}") from e  # MaxText's own words
      if saved:
        print_save_message(actual_step, mtc_config.as_bool(
            "async_checkpointing", mtc_config.value_of(config, "async_checkpointing")))
        logging.debug("maxtext_patch: save of step %d blocked %.3fs", actual_step,
                      time.perf_counter() - started)
  # Every process asks at every step (the sync point counts the asks), saved or not.
  _after_save(checkpoint_manager, actual_step, force)
