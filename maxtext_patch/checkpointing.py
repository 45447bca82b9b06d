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
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers as policies

import orbax_mtc as mtc
from maxtext_patch import config as mtc_config

_STATE_ITEM = "state"  # MaxText's item name for the emergency managers
_ITEMS = "items"  # MaxText's item name for its standard manager
_ITER = "iter"  # MaxText's item name for the grain data iterator (0.2.0 to 0.2.5 alike)
_GRAIN = "grain"  # the dataset_type whose iterator MaxText checkpoints


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
_extra_keys: dict[str, Any] = {}
_current_config: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "maxtext_patch_config", default=None)
# MaxText's loader for load_parameters_path / load_full_state_path (set by install()).
_fallback_loader: Callable[..., tuple[Any, Any]] | None = None
# The state layout the factories give the manager as its abstract state; None: ours
# (`_checkpoint_tree`). install() sets MaxText's own when MaxText's functions save.
_state_layout: Callable[[Any], Any] | None = None


def set_state_layout(layout: Callable[[Any], Any] | None) -> None:
  """Sets how the standalone factory lays out the abstract state.

  MaxText's layout when MaxText's own functions save and restore (they convert the state the
  same way), else ours.

  Args:
    layout: Maps a train state to the tree the manager saves; None for ours (nested dicts
      keyed by field names).
  """
  global _state_layout
  _state_layout = layout


def _stop(reason: str) -> Exception:
  return _stop_class(reason)


def set_extra_keys(keys: Mapping[str, Any]) -> None:
  """Sets the orbax-mtc keys (`mtc_peers_per_node`, ...) for managers built from now on.

  Args:
    keys: orbax-mtc key -> value (strings from a command line accepted).

  Raises:
    MaxTextConfigError: If a key is unknown or its value malformed.
  """
  global _extra_keys
  _extra_keys = mtc_config.check_new_keys(keys)


def extra_keys() -> dict[str, Any]:
  """The orbax-mtc keys set by `set_extra_keys`, typed (a copy)."""
  return dict(_extra_keys)


@contextlib.contextmanager
def using_config(config: Any) -> Iterator[None]:
  """Makes `config` the one the manager factories read their other keys from.

  Args:
    config: A MaxText config (HyperParameters or a dict), in effect inside the `with` block.
  """
  token = _current_config.set(config)
  try:
    yield
  finally:
    _current_config.reset(token)


def is_multi_tier(checkpoint_manager: Any) -> bool:
  """Whether a manager is an orbax-mtc manager in its multi-tier form.

  Args:
    checkpoint_manager: Any object (a manager or None).

  Returns:
    True for a multi-tier `orbax_mtc.CheckpointManager` (built by the factories below); False
    for a plain or parent-style Orbax manager, or anything else.
  """
  return isinstance(checkpoint_manager, mtc.CheckpointManager) and isinstance(
      checkpoint_manager.options, mtc.CheckpointManagerOptions)


# ------------------------------------------------------------------ state layout


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _checkpoint_tree(tree: Any) -> dict[str, Any]:
  """The leaves of `tree` as nested dicts keyed by dict keys, attribute names and indices.

  Why: Orbax writes dataclass and namedtuple nodes as dicts, so a persistent checkpoint read
  back against a `TrainState` target does not match it leaf for leaf; nested dicts are the
  same tree in every tier.
  """
  out: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [_key_name(k) for k in path] or ["value"]
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise ValueError(f"State leaf path {jax.tree_util.keystr(path)} clashes with another "
                         "leaf of the same name.")
    if keys[-1] in node:
      raise ValueError(f"Two state leaves map to the name {jax.tree_util.keystr(path)}.")
    node[keys[-1]] = leaf
  return out


def _from_checkpoint_tree(nested: Mapping[str, Any], like: Any) -> Any:
  """`_checkpoint_tree`'s inverse: the leaves of `nested` put back into `like`'s structure."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  leaves = []
  for path, _ in paths:
    node: Any = nested
    for key in [_key_name(k) for k in path] or ["value"]:
      node = node[key]
    leaves.append(node)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_pytree(state: Any) -> Any:
  """An NNX train state (a Module, MaxText's `TrainStateNNX`) as its `nnx.State`; other
  states as they are."""
  try:
    from flax import nnx
  except ImportError:
    return state
  return nnx.state(state) if isinstance(state, nnx.Module) else state


def _state_step(state: Any) -> int:
  """`state.step` of a Linen TrainState, a dict or an NNX optimizer state."""
  for get in (lambda s: s.step, lambda s: s["step"], lambda s: s.optimizer.step):
    try:
      return int(get(state))
    except (AttributeError, KeyError, TypeError):
      continue
  raise ValueError("Cannot find the step of the training state (state.step, state['step'] or "
                   "state.optimizer.step); pass step= to maybe_save_checkpoint.")


# ------------------------------------------------------------------ data iterator

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


# ------------------------------------------------------------------ managers


def _settings(overrides: Mapping[str, Any]) -> mtc_config.MtcSettings:
  config = _current_config.get()
  if config is not None:
    check_iterator_keys(config)  # before training starts, not at its first save
  settings = mtc_config.read_settings(config if config is not None else {}, _extra_keys,
                                      overrides)
  assert settings is not None  # the overrides set one of the two flags
  return settings


def _build(settings: mtc_config.MtcSettings, global_mesh: jax.sharding.Mesh,
           abstract_state: Any, orbax_logger: Any = None) -> mtc.CheckpointManager:
  if not isinstance(global_mesh, jax.sharding.Mesh):
    raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
  mtc_config.check_mesh(settings, global_mesh.axis_names)
  platform = global_mesh.devices.flat[0].platform
  local = mtc_config.local_directory_for(settings.local_directory, jax.process_index(),
                                         platform)
  os.makedirs(local, exist_ok=True)
  layout = _state_layout or _checkpoint_tree
  abstract = None if abstract_state is None else layout(abstract_state)
  manager = mtc.CheckpointManager(local, settings.persistent_directory, global_mesh, abstract,
                                  options=mtc_config.manager_options(settings),
                                  logger=orbax_logger)
  logging.info(
      "maxtext_patch: orbax-mtc %s manager: RAM %s every %d steps, persistent %s %s, peers "
      "per node %s along %r", settings.mode, local, settings.local_interval,
      settings.persistent_directory,
      f"every {settings.backup_interval_minutes:g} min" if settings.backup_interval_minutes
      else f"every {settings.persistent_interval_steps} steps",
      "default" if settings.peers_per_node is None else settings.peers_per_node,
      settings.replica_axis)
  return manager


def create_orbax_emergency_checkpoint_manager(
    local_checkpoint_dir: str,
    persistent_checkpoint_dir: str,
    global_mesh: jax.sharding.Mesh,
    abstract_state: Any,
    local_save_interval_steps: int,
    persistent_save_interval_steps: int,
    orbax_logger: Any = None,
) -> mtc.CheckpointManager:
  """Standalone orbax-mtc manager (RAM tier + peers + persistent tier), MaxText's signature.

  The other keys (backup minutes, retention, async, mtc_*) come from the config given to
  `using_config` (MaxText's `create_checkpoint_manager` does that once installed).

  Args:
    local_checkpoint_dir: This host's RAM disk (`{process_index}` is replaced); created if
      missing.
    persistent_checkpoint_dir: The persistent tier's directory.
    global_mesh: The mesh the job trains on.
    abstract_state: The train state's abstract form (shapes, dtypes, shardings).
    local_save_interval_steps: RAM-tier save interval in steps.
    persistent_save_interval_steps: Persistent backup interval in steps.
    orbax_logger: Orbax's logger for the manager, or None.

  Returns:
    The standalone multi-tier manager.

  Raises:
    MaxTextConfigError: If a config key is unusable or the replica axis is not a mesh axis.
    TypeError: If `global_mesh` is not a `jax.sharding.Mesh`.
  """
  settings = _settings({
      "enable_emergency_checkpoint": True, "enable_multi_tier_checkpointing": False,
      "local_checkpoint_directory": str(local_checkpoint_dir),
      "checkpoint_dir": str(persistent_checkpoint_dir),
      "local_checkpoint_period": local_save_interval_steps,
      "checkpoint_period": persistent_save_interval_steps,
  })
  return _build(settings, global_mesh, abstract_state, orbax_logger)


def create_orbax_emergency_replicator_checkpoint_manager(
    local_checkpoint_dir: str,
    save_interval_steps: int,
    global_mesh: jax.sharding.Mesh,
    colocated_python_checkpointing: bool = False,
) -> mtc.CheckpointManager:
  """Managed orbax-mtc manager (GKE's replicator copies and backs up), MaxText's signature.

  The persistent directory (read when the replicator has nothing) is the config's
  `checkpoint_dir`.

  Args:
    local_checkpoint_dir: The replicator's volume on this host; created if missing.
    save_interval_steps: RAM-tier save interval in steps.
    global_mesh: The mesh the job trains on.
    colocated_python_checkpointing: Pathways' colocated Python; True is refused.

  Returns:
    The managed multi-tier manager.

  Raises:
    MaxTextConfigError: If a config key is unusable (Pathways included) or the replica axis
      is not a mesh axis.
    TypeError: If `global_mesh` is not a `jax.sharding.Mesh`.
  """
  settings = _settings({
      "enable_emergency_checkpoint": False, "enable_multi_tier_checkpointing": True,
      "local_checkpoint_directory": str(local_checkpoint_dir),
      "local_checkpoint_period": save_interval_steps,
      "colocated_python_checkpointing": colocated_python_checkpointing,
  })
  return _build(settings, global_mesh, None)


def create_orbax_checkpoint_manager(
    checkpoint_dir: str,
    enable_checkpointing: bool,
    use_async: bool,
    save_interval_steps: int,
    dataset_type: None | str = None,
    orbax_logger: Any = None,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    enable_continuous_checkpointing: bool = False,
    max_num_checkpoints_to_keep: int = 10,
    checkpoint_storage_concurrent_gb: int = 96,
    enable_autocheckpoint: bool = False,
    todelete_subdir: str | None = None,
    todelete_full_path: str | None = None,
) -> mtc.CheckpointManager | None:
  """A one-tier manager on `checkpoint_dir`, with MaxText's item name and save policies.

  It is orbax-mtc's parent-style form, which is exactly `ocp.CheckpointManager`. The data
  iterator is not checkpointed here (`dataset_type` is accepted for the signature).

  Args:
    checkpoint_dir: The checkpoint directory.
    enable_checkpointing: False returns None.
    use_async: Save in the background.
    save_interval_steps: Save every N steps.
    dataset_type: Accepted and ignored.
    orbax_logger: Orbax's logger for the manager, or None.
    use_ocdbt: Passed to `ocp.PyTreeCheckpointHandler`.
    use_zarr3: Passed to `ocp.PyTreeCheckpointHandler`.
    enable_continuous_checkpointing: Use Orbax's `ContinuousCheckpointingPolicy` instead of the
      interval.
    max_num_checkpoints_to_keep: Steps kept (`LatestN`); 0 or None keeps all.
    checkpoint_storage_concurrent_gb: The handler's save and restore byte limit in GB.
    enable_autocheckpoint: Also save at the preemption step.
    todelete_subdir: Passed to Orbax's `CheckpointManagerOptions`.
    todelete_full_path: Passed to Orbax's `CheckpointManagerOptions`.

  Returns:
    The manager, or None when checkpointing is off.
  """
  del dataset_type  # grain iterators are MaxText's own handler; not part of this loop
  if not enable_checkpointing:
    logging.info("maxtext_patch: checkpointing disabled, no checkpoint manager.")
    return None
  if enable_continuous_checkpointing:
    save_policy: policies.SaveDecisionPolicy = policies.ContinuousCheckpointingPolicy()
  elif enable_autocheckpoint:
    save_policy = policies.AnySavePolicy([policies.PreemptionCheckpointingPolicy(),
                                          policies.FixedIntervalPolicy(save_interval_steps)])
  else:
    save_policy = policies.FixedIntervalPolicy(save_interval_steps)
  handler = ocp.PyTreeCheckpointHandler(
      use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, save_concurrent_gb=checkpoint_storage_concurrent_gb,
      restore_concurrent_gb=checkpoint_storage_concurrent_gb)
  return mtc.CheckpointManager(
      checkpoint_dir,
      options=ocp.CheckpointManagerOptions(
          create=True, enable_async_checkpointing=use_async, save_decision_policy=save_policy,
          preservation_policy=(policies.LatestN(max_num_checkpoints_to_keep)
                               if max_num_checkpoints_to_keep else None),
          todelete_subdir=todelete_subdir, todelete_full_path=todelete_full_path),
      item_names=(_ITEMS,), item_handlers={_ITEMS: handler}, logger=orbax_logger)


def _abstract_state(init_state_fn: Callable[[], Any]) -> Any:
  abstract = jax.eval_shape(init_state_fn)
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    if not isinstance(getattr(leaf, "sharding", None), jax.sharding.Sharding):
      raise ValueError(
          f"init_state_fn's output {jax.tree_util.keystr(path)} has no sharding: jit it with "
          "out_shardings (as MaxText does) so that the checkpoint knows where each shard goes.")
  return abstract


def create_checkpoint_manager(config: Any, mesh: jax.sharding.Mesh,
                              init_state_fn: Callable[[], Any]) -> Any:
  """MaxText's `train_utils.create_checkpoint_manager`: the manager the config asks for.

  Args:
    config: A MaxText config (HyperParameters or a dict).
    mesh: The mesh the job trains on.
    init_state_fn: Returns the initial training state (jitted with out_shardings); it is only
      traced (`jax.eval_shape`) here.

  Returns:
    A standalone or managed multi-tier manager when the config enables one, else a one-tier
    manager (`create_orbax_checkpoint_manager`), or None when checkpointing is off.

  Raises:
    MaxTextConfigError: If a config key is unusable.
    ValueError: If a leaf of `init_state_fn`'s output has no sharding.
    TypeError: If `mesh` is not a `jax.sharding.Mesh` (multi-tier forms).
  """
  mode = mtc_config.enabled_mode(config)
  get = lambda key: mtc_config.value_of(config, key)  # noqa: E731
  with using_config(config):
    if mode == mtc_config.MANAGED:
      return create_orbax_emergency_replicator_checkpoint_manager(
          get("local_checkpoint_directory"), get("local_checkpoint_period"), mesh)
    if mode == mtc_config.STANDALONE:
      return create_orbax_emergency_checkpoint_manager(
          get("local_checkpoint_directory"), get("checkpoint_dir"), mesh,
          _abstract_state(init_state_fn), get("local_checkpoint_period"),
          get("checkpoint_period"))
    enabled = mtc_config.as_bool("enable_checkpointing", get("enable_checkpointing"))
    return create_orbax_checkpoint_manager(
        get("checkpoint_dir") if enabled else "", enabled,
        mtc_config.as_bool("async_checkpointing", get("async_checkpointing")),
        int(get("checkpoint_period")),
        max_num_checkpoints_to_keep=get("max_num_checkpoints_to_keep"),
        enable_autocheckpoint=mtc_config.as_bool("enable_autocheckpoint",
                                                 get("enable_autocheckpoint")))


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
