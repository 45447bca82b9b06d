"""The manager factories, MaxText's signatures: multi-tier (standalone, managed) and one-tier.

The keys they read besides their arguments are set here: the orbax-mtc keys
(`set_extra_keys`), the MaxText config in effect (`using_config`) and the layout of the
abstract state (`set_state_layout`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers as policies

import orbax_mtc as mtc
from maxtext_patch import config as mtc_config
from maxtext_patch.items import _ITEMS
from maxtext_patch.iterators import check_iterator_keys
from maxtext_patch.state_tree import _checkpoint_tree

_extra_keys: dict[str, Any] = {}
_current_config: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "maxtext_patch_config", default=None)
# The state layout the factories give the manager as its abstract state; None: ours
# (`_checkpoint_tree`). install() sets MaxText's own when MaxText's functions save.
_state_layout: Callable[[Any], Any] | None = None
# The last multi-tier manager the factories built: asked after training whether it stopped at
# the preemption step (MaxText ends both ways with status 0; see `stopped_for_preemption`).
_last_built: mtc.CheckpointManager | None = None


def stopped_for_preemption() -> bool:
  """Whether the last multi-tier manager built here reached its preemption step.

  MaxText's training ends with status 0 whether it finished or stopped after the on-demand
  checkpoint of a SIGTERM; a restart loop needs to tell the two apart.

  Returns:
    True once that manager's agreed preemption step was reached; False before, or when no
    multi-tier manager was built.
  """
  return _last_built is not None and bool(_last_built.should_exit())


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
  global _last_built
  _last_built = manager
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
