"""The grain data iterator's position, saved and restored as item `iter` of a multi-tier step.

Which iterator MaxText checkpoints (`checkpointed_iterator`, `check_iterator_keys`), the save
and restore args of item `iter`, a restore that tolerates steps saved without it
(`restore_with_iterator`), and the carrying of the iterator to MaxText >= 0.2.4's own emergency
save and restore (`carrying_iterator`, `with_carried_iterator`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp
from absl import logging

import orbax_mtc as mtc
from maxtext_patch import config as mtc_config
from maxtext_patch.items import _GRAIN, _ITER, is_multi_tier

# The iterator a MaxText save or restore in progress carries to MaxText's emergency module
# (MaxText >= 0.2.4 drives orbax-mtc through it; `install()` sets this, see `carrying_iterator`).
_carried_iterator: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "maxtext_patch_iterator", default=None)


def _scaled_loading(factor: Any) -> bool:
  """Whether `expansion_factor_real_data` asks for MaxText's scaled data loading: > 1 (some hosts
  load for others) or in (0, 1) (each host restores several hosts' iterators)."""
  try:
    value = float(factor if factor is not None else -1)
  except (TypeError, ValueError):
    return False  # MaxText's own config check reports it
  return value > 0 and value != 1


def check_iterator_keys(config: Any) -> None:
  """Refuses data-loading keys whose grain iterator orbax-mtc cannot checkpoint.

  With `dataset_type=grain` a multi-tier save holds each process's iterator position as item
  `iter`. MaxText's scaled loading (`expansion_factor_real_data` other than -1 or 1: hosts
  without data, or several iterators per host) and Pathways' remote iterator
  (`colocated_python_data_input`) have no one position per process.

  Args:
    config: A MaxText config (HyperParameters or a dict).

  Raises:
    MaxTextConfigError: For those keys with `dataset_type=grain`.
  """
  if mtc_config.value_of(config, "dataset_type") != _GRAIN:
    return
  factor = mtc_config.value_of(config, "expansion_factor_real_data")
  if _scaled_loading(factor):
    raise mtc_config.MaxTextConfigError(
        f"expansion_factor_real_data={factor} with dataset_type=grain: orbax-mtc checkpoints "
        "each process's own grain iterator position (item 'iter'), and MaxText's scaled "
        "loading has hosts without one (> 1) or with several (< 1). Set "
        "expansion_factor_real_data=-1, or use MaxText's own checkpointing (without "
        "enable_emergency_checkpoint / enable_multi_tier_checkpointing).")
  if mtc_config.as_bool("colocated_python_data_input",
                        mtc_config.value_of(config, "colocated_python_data_input") or False):
    raise mtc_config.MaxTextConfigError(
        "colocated_python_data_input=true with dataset_type=grain: the iterator runs in "
        "Pathways' colocated Python, which orbax-mtc does not support. Turn it off or use "
        "MaxText's own checkpointing.")


def checkpointed_iterator(dataset_type: str | None, data_iterator: Any,
                          expansion_factor_real_data: Any = -1) -> Any:
  """The per-process iterator MaxText checkpoints as item `iter`, or None.

  As MaxText's `grain_utility.for_save` (0.2.5) and `save_checkpoint` (0.2.0): only for
  `dataset_type="grain"`, the `local_iterator` of MaxText's `MultiHostDataLoadIterator` (the
  grain iterator that host reads), or the iterator itself when it has none.

  Args:
    dataset_type: MaxText's `dataset_type`.
    data_iterator: MaxText's train data iterator, or None.
    expansion_factor_real_data: MaxText's key of that name.

  Returns:
    The iterator to save and restore; None for other dataset types, no iterator, or MaxText's
    `PlaceHolderDataIterator` (a host that loads no real data).

  Raises:
    MaxTextConfigError: Scaled loading (`check_iterator_keys`), a list of iterators, or
      Pathways' remote iterator.
    TypeError: If the iterator has no `get_state`/`set_state`.
  """
  if dataset_type != _GRAIN:
    return None
  kind = type(data_iterator).__name__
  # The keys first: they are the same on every process, whatever iterator this one has.
  check_iterator_keys({"dataset_type": _GRAIN,
                       "expansion_factor_real_data": expansion_factor_real_data,
                       "colocated_python_data_input": kind == "RemoteIteratorWrapper"})
  if data_iterator is None or kind == "PlaceHolderDataIterator":
    return None
  if isinstance(data_iterator, (list, tuple)):
    raise mtc_config.MaxTextConfigError(
        f"A list of {len(data_iterator)} data iterators (MaxText's scaled loading) cannot be "
        "checkpointed by orbax-mtc: one grain iterator per process is; set "
        "expansion_factor_real_data=-1.")
  local = getattr(data_iterator, "local_iterator", data_iterator)
  if not (callable(getattr(local, "get_state", None)) and
          callable(getattr(local, "set_state", None))):
    raise TypeError(
        f"dataset_type=grain, but the data iterator ({type(local).__name__}) has no "
        "get_state/set_state: orbax-mtc checkpoints grain iterators only.")
  return local


def _grain_native(iterator: Any) -> bool:
  """Whether Grain's own checkpoint args take `iterator` (a DatasetIterator or a
  DataLoaderIterator); others (grain's ElasticIterator) are saved as their JSON state."""
  import grain

  return isinstance(iterator, (grain.DatasetIterator, grain.DataLoaderIterator))


def iterator_save_args(iterator: Any) -> Any:
  """Save args of item `iter`: Grain's `CheckpointSave`, or the state as JSON.

  Args:
    iterator: The iterator `checkpointed_iterator` returned.
  """
  if _grain_native(iterator):
    import grain.checkpoint

    return grain.checkpoint.CheckpointSave(iterator)
  return mtc.ProcessJsonSave(iterator.get_state())


def iterator_restore_args(iterator: Any) -> Any:
  """Restore args of item `iter` (see `iterator_save_args`).

  Args:
    iterator: The iterator to restore into.
  """
  if _grain_native(iterator):
    import grain.checkpoint

    return grain.checkpoint.CheckpointRestore(iterator)
  return mtc.ProcessJsonRestore()


def _lacks_item(error: Exception, name: str) -> bool:
  """Whether a restore failed only because the step holds no item `name` at all (saved
  without it), in any tier; another process count is not that."""
  return isinstance(error, mtc.MissingItemError) and error.item == name


def restore_with_iterator(checkpoint_manager: Any, step: int | None, args: Any,
                          iterator: Any) -> Any:
  """`checkpoint_manager.restore(step, args=args)`, with item `iter` restored into `iterator`.

  A step saved without the iterator (by MaxText's own emergency manager, or before
  `dataset_type=grain`) restores `args` alone; the iterator keeps its start, with a warning.

  Args:
    checkpoint_manager: A multi-tier orbax-mtc manager.
    step: The step, or None for the newest every process can assemble.
    args: `ocp.args.Composite` of the other items.
    iterator: The iterator (`checkpointed_iterator`), set to the saved position in place.

  Returns:
    The restored Composite, or None when there is nothing to restore (`step=None`).

  Raises:
    AbstractStateMismatchError: As `restore`; for `iter` too when the step was saved by
      another process count (a position belongs to the process that saved it).
  """
  with_iter = ocp.args.Composite(**dict(args.items()), **{_ITER: iterator_restore_args(iterator)})
  try:
    restored = checkpoint_manager.restore(step, args=with_iter)
  except mtc.AbstractStateMismatchError as e:
    if not _lacks_item(e, _ITER):
      raise
    logging.warning("maxtext_patch: %s holds no data iterator position (it was saved "
                    "without item %r); the iterator starts from its beginning.",
                    "the newest step" if step is None else f"step {step}", _ITER)
    return checkpoint_manager.restore(step, args=args)
  if restored is not None and not _grain_native(iterator):
    iterator.set_state(restored[_ITER])
  return restored


class _IteratorManager:
  """A multi-tier manager as MaxText's emergency `save` and `restore` see it during a grain
  run: their `Composite(state=...)` gets item `iter` added (everything else is the manager)."""

  def __init__(self, manager: Any, iterator: Any):
    self._manager = manager
    self._iterator = iterator

  def __getattr__(self, name: str) -> Any:
    return getattr(self._manager, name)

  def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
    items = kwargs.get("args")
    if isinstance(items, ocp.args.Composite) and _ITER not in items:
      kwargs["args"] = ocp.args.Composite(**dict(items.items()),
                                          **{_ITER: iterator_save_args(self._iterator)})
    return self._manager.save(step, *args, **kwargs)

  def restore(self, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
    items = kwargs.get("args")
    if args or set(kwargs) != {"args"} or not isinstance(items, ocp.args.Composite) or \
        _ITER in items:
      return self._manager.restore(step, *args, **kwargs)
    return restore_with_iterator(self._manager, step, items, self._iterator)


@contextlib.contextmanager
def carrying_iterator(iterator: Any) -> Iterator[None]:
  """Makes `iterator` the one `with_carried_iterator` adds to saves and restores in the block
  (MaxText's save_checkpoint / load_state_if_possible, which do not pass it on to MaxText's
  emergency module).

  Args:
    iterator: The iterator (`checkpointed_iterator`), or None for none.
  """
  token = _carried_iterator.set(iterator)
  try:
    yield
  finally:
    _carried_iterator.reset(token)


def with_carried_iterator(checkpoint_manager: Any) -> Any:
  """The manager MaxText's emergency `save`/`restore` should use: a multi-tier manager with
  the carried iterator added to its saves and restores, else `checkpoint_manager` itself.

  Args:
    checkpoint_manager: The manager MaxText passes.
  """
  iterator = _carried_iterator.get()
  if iterator is None or not is_multi_tier(checkpoint_manager):
    return checkpoint_manager
  return _IteratorManager(checkpoint_manager, iterator)
