"""MaxText on orbax-mtc: one flag in a MaxText config switches its checkpointing.

  python -m maxtext_patch.train <MaxText config> enable_emergency_checkpoint=true \\
      local_checkpoint_directory=/local local_checkpoint_period=20 [mtc_peers_per_node=1 ...]

`install()` points MaxText's emergency checkpoint manager factories at
`maxtext_patch.checkpointing` at run time (no MaxText file is edited or copied): with
`enable_emergency_checkpoint=true` MaxText gets a standalone `orbax_mtc.CheckpointManager`
(RAM tier, peer copies, persistent backups), with `enable_multi_tier_checkpointing=true` a
managed one (GKE's replicator). MaxText's own save and restore functions then drive it as
they drive Orbax's emergency managers (MaxText >= 0.2.4; older ones get
`maxtext_patch.checkpointing`'s). With `dataset_type=grain` each process's data iterator
position is saved and restored with the state, as item `iter` (MaxText's name for it), in every
tier. Other configs keep MaxText's own checkpointing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

from maxtext_patch import checkpointing
from maxtext_patch import config as mtc_config

SUPPORTED_MAXTEXT = ">=0.2.0,<0.3"
_SUPPORTED_RANGE = ((0, 2, 0), (0, 3, 0))
_PATCHED = "__maxtext_patch__"  # marks a function this package put in MaxText's modules
_JAX_INIT_INFO_FILE = "jax-init-info.txt"  # GKE writes it into the local volume

__all__ = ["SUPPORTED_MAXTEXT", "MaxTextNotAvailableError", "UnsupportedMaxTextError",
           "install", "installed_version"]


class MaxTextNotAvailableError(ImportError):
  """MaxText cannot be imported in this environment."""


class UnsupportedMaxTextError(RuntimeError):
  """The MaxText found is outside the versions this patch knows."""


_installed: str | None = None


def installed_version() -> str | None:
  """The MaxText version `install()` patched.

  Returns:
    The version, "unknown" if `install()` could not tell it, or None before it ran.
  """
  return _installed


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _maxtext_version() -> str | None:
  try:
    return importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError:
    pass
  try:  # a source checkout on sys.path (MaxText >= 0.2.4 has maxtext/version.py)
    return importlib.import_module("maxtext.version").__version__
  except (ImportError, AttributeError):
    return None


def _not_available(reason: BaseException) -> MaxTextNotAvailableError:
  python = f"{sys.version_info.major}.{sys.version_info.minor}"
  return MaxTextNotAvailableError(
      f"MaxText is not importable here ({type(reason).__name__}: {reason}). maxtext_patch "
      f"supports MaxText {SUPPORTED_MAXTEXT} (the `maxtext.common.checkpointing` layout), which "
      f"needs Python >= 3.12 (this is Python {python}). Install it (pip install "
      f"'maxtext{SUPPORTED_MAXTEXT}', or MaxText's source checkout on PYTHONPATH), or call "
      "maxtext_patch.checkpointing from your own training loop, which needs no MaxText.")


def _import(name: str, *, required: bool = True) -> Any:
  try:
    return importlib.import_module(name)
  except ImportError as e:
    if required:
      raise _not_available(e) from e
    return None


def _require(module: Any, *names: str) -> None:
  missing = [n for n in names if not hasattr(module, n)]
  if missing:
    raise UnsupportedMaxTextError(
        f"{module.__name__} has no {', '.join(missing)}: this MaxText is not one maxtext_patch "
        f"knows (supported: {SUPPORTED_MAXTEXT}).")


def _dispatching(original: Callable[..., Any], ours: Callable[..., Any],
                 manager_arg: str = "checkpoint_manager") -> Callable[..., Any]:
  """`original` with orbax-mtc managers handed to `ours` (same parameters by name)."""
  signature = inspect.signature(original)
  accepted = set(inspect.signature(ours).parameters)

  @functools.wraps(original)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    bound = signature.bind(*args, **kwargs)
    if checkpointing.is_multi_tier(bound.arguments.get(manager_arg)):
      return ours(**{k: v for k, v in bound.arguments.items() if k in accepted})
    return original(*args, **kwargs)

  setattr(wrapper, _PATCHED, True)
  return wrapper


def _carrying_iterator(original: Callable[..., Any],
                       iterator_of: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
  """`original` (MaxText's save_checkpoint or load_state_if_possible) with, for an orbax-mtc
  manager, the grain iterator `iterator_of(arguments)` carried to MaxText's emergency module
  (see `_emergency_with_iterator`), which MaxText calls without it."""
  signature = inspect.signature(original)

  @functools.wraps(original)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if not checkpointing.is_multi_tier(bound.arguments.get("checkpoint_manager")):
      return original(*args, **kwargs)
    with checkpointing.carrying_iterator(iterator_of(bound.arguments)):
      return original(*args, **kwargs)

  setattr(wrapper, _PATCHED, True)
  return wrapper


def _saved_iterator(arguments: dict[str, Any]) -> Any:
  """The iterator MaxText's `save_checkpoint(checkpoint_manager, step, state, config,
  data_iterator, force)` saves with the step (its config's dataset_type), or None."""
  config = arguments.get("config")
  if config is None:
    return None
  return checkpointing.checkpointed_iterator(
      mtc_config.value_of(config, "dataset_type"), arguments.get("data_iterator"),
      mtc_config.value_of(config, "expansion_factor_real_data"))


def _restored_iterator(arguments: dict[str, Any]) -> Any:
  """The iterator MaxText's `load_state_if_possible(...)` restores, or None."""
  return checkpointing.checkpointed_iterator(
      arguments.get("dataset_type"), arguments.get("data_iterator"),
      arguments.get("expansion_factor_real_data", -1))


def _emergency_with_iterator(original: Callable[..., Any]) -> Callable[..., Any]:
  """MaxText's emergency `save(checkpoint_manager, ...)` / `restore(checkpoint_manager, ...)`
  with the carried grain iterator added to the manager's Composite as item `iter`."""

  @functools.wraps(original)
  def wrapper(checkpoint_manager: Any, *args: Any, **kwargs: Any) -> Any:
    return original(checkpointing.with_carried_iterator(checkpoint_manager), *args, **kwargs)

  setattr(wrapper, _PATCHED, True)
  return wrapper


def _with_config(original: Callable[..., Any]) -> Callable[..., Any]:
  """`original(config, ...)` run with `config` visible to the manager factories."""

  @functools.wraps(original)
  def wrapper(config: Any, *args: Any, **kwargs: Any) -> Any:
    with checkpointing.using_config(config):
      return original(config, *args, **kwargs)

  setattr(wrapper, _PATCHED, True)
  return wrapper


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
  setattr(fn, _PATCHED, True)
  return fn


def _set(module: Any, name: str, value: Callable[..., Any]) -> None:
  if getattr(getattr(module, name, None), _PATCHED, False):
    return  # installed before
  setattr(module, name, value)


def _initialize_multi_tier_checkpointing(
    local_checkpoint_directory: Any, *, backup_interval_minutes: float | None = None,
    backup_interval_steps: int | None = None, num_slices: int | None = None,
    run_name: str | None = None, data_parallelism: int | None = None,
    jax_initialization_timeout_seconds: int = 900, jax_shutdown_timeout_seconds: int = 300,
    use_mtc_process_ids: bool = True, use_colocated_python: bool = False, devices: Any = None,
) -> int | None:
  """Orbax's `initialize_multi_tier_checkpointing` signature (what MaxText calls), run by
  orbax-mtc's, with mtc_peers_per_node passed on."""
  del jax_shutdown_timeout_seconds, devices  # JAX's defaults; orbax-mtc does not take them
  if use_colocated_python:
    raise mtc_config.MaxTextConfigError(
        "enable_multi_tier_checkpointing with Pathways (colocated Python) is not supported by "
        "orbax-mtc; run multi-controller (one JAX process per host).")
  import orbax_mtc  # late: managed mode may be newer than this package's other uses

  init = getattr(orbax_mtc, "initialize_multi_tier_checkpointing", None)
  if init is None:
    raise mtc_config.MaxTextConfigError(
        "enable_multi_tier_checkpointing=true needs orbax_mtc.initialize_multi_tier_checkpointing "
        "(managed mode), which this orbax-mtc does not have.")
  peers = checkpointing.extra_keys().get("mtc_peers_per_node")
  return init(
      local_checkpoint_directory, backup_interval_minutes=backup_interval_minutes,
      backup_interval_steps=backup_interval_steps, num_slices=num_slices, run_name=run_name,
      data_parallelism=data_parallelism,
      peers_per_node=peers,
      jax_initialization_timeout_seconds=jax_initialization_timeout_seconds,
      use_mtc_process_ids=use_mtc_process_ids)


def _tpu_emergency_init(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """MaxText waits for GKE's jax-init-info.txt when enable_emergency_checkpoint is set on TPU;
  orbax-mtc runs anywhere, so without that file JAX finds its cluster itself."""

  @functools.wraps(original)
  def wrapper(raw_keys: Any) -> Any:
    import os

    from orbax_mtc import distributed

    local = str(raw_keys["local_checkpoint_directory"])
    if os.path.exists(os.path.join(local, _JAX_INIT_INFO_FILE)):
      return original(raw_keys)
    distributed.initialize(timeout_s=int(raw_keys.get("jax_distributed_initialization_timeout",
                                                      300)))
    return None

  setattr(wrapper, _PATCHED, True)
  return wrapper


def install(*, check_version: bool = True, **mtc_keys: Any) -> str | None:
  """Makes MaxText's checkpointing run on orbax-mtc.

  Only configs that enable emergency or multi-tier checkpointing are affected. Call it before
  MaxText builds its config (that is where MaxText joins jax.distributed). Calling it again
  leaves what it patched before in place.

  Args:
    check_version: Refuse a MaxText outside SUPPORTED_MAXTEXT; False tries anyway.
    **mtc_keys: orbax-mtc's own keys (`mtc_peers_per_node=1`, `mtc_replica_axis="data"`,
      ...; see `maxtext_patch.config.NEW_KEYS`), which MaxText's config would reject.

  Returns:
    The MaxText version patched, or None if it cannot be told.

  Raises:
    MaxTextNotAvailableError: If MaxText cannot be imported (it needs Python >= 3.12).
    UnsupportedMaxTextError: If the MaxText is outside SUPPORTED_MAXTEXT (`check_version=False`
      tries anyway) or lacks the functions patched.
    MaxTextConfigError: If an mtc_* key is unknown or malformed.
  """
  global _installed
  keys = mtc_config.check_new_keys(mtc_keys)
  ckpt = _import("maxtext.common.checkpointing")
  train_utils = _import("maxtext.utils.train_utils")
  max_utils = _import("maxtext.utils.max_utils")
  exceptions = _import("maxtext.utils.exceptions")
  emergency = _import("maxtext.common.emergency_checkpointing", required=False)
  version = _maxtext_version()
  if check_version and version is not None:
    low, high = _SUPPORTED_RANGE
    if not low <= _version_tuple(version) < high:
      raise UnsupportedMaxTextError(
          f"MaxText {version} is outside the versions maxtext_patch supports "
          f"({SUPPORTED_MAXTEXT}); install one of those, or install(check_version=False) to "
          "try anyway.")
  _require(ckpt, "create_orbax_emergency_checkpoint_manager",
           "create_orbax_emergency_replicator_checkpoint_manager", "load_state_if_possible",
           "maybe_save_checkpoint", "save_checkpoint")
  _require(exceptions, "StopTraining")
  factory_holder = next((n for n in ("create_checkpoint_manager", "create_training_tools")
                         if hasattr(train_utils, n)), None)
  if factory_holder is None:
    raise UnsupportedMaxTextError(
        "maxtext.utils.train_utils has neither create_checkpoint_manager nor "
        f"create_training_tools (supported MaxText: {SUPPORTED_MAXTEXT}).")

  checkpointing.set_extra_keys(keys)
  # MaxText >= 0.2.4 saves and restores through its emergency module for any manager that is
  # an Orbax emergency manager (ours is registered as one below): its own layout (Linen
  # params/opt_state/step plus nnx_aux), its own error handling. The factories change, and
  # a grain iterator is carried to its emergency save and restore.
  drives_emergency = emergency is not None and all(
      hasattr(emergency, n) for n in ("save", "restore"))
  checkpointing.set_state_layout(_maxtext_layout() if drives_emergency else None)
  # One exception that both MaxText's train loop and a loop of ours catch.
  if not issubclass(checkpointing._stop_class, exceptions.StopTraining):
    checkpointing._stop_class = type(
        "StopTraining", (exceptions.StopTraining, checkpointing.StopTraining), {})

  original_load = ckpt.load_state_if_possible
  if not getattr(original_load, _PATCHED, False):
    load_params = set(inspect.signature(original_load).parameters)

    def original_loader(**kwargs: Any) -> Any:
      return original_load(**{k: v for k, v in kwargs.items() if k in load_params})

    checkpointing._fallback_loader = original_loader
  standalone = _marked(checkpointing.create_orbax_emergency_checkpoint_manager)
  managed = _marked(checkpointing.create_orbax_emergency_replicator_checkpoint_manager)
  _set(ckpt, "create_orbax_emergency_checkpoint_manager", standalone)
  _set(ckpt, "create_orbax_emergency_replicator_checkpoint_manager", managed)
  if emergency is not None:  # MaxText >= 0.2.4 calls these names from train_utils
    if hasattr(emergency, "create_emergency_checkpoint_manager"):
      _set(emergency, "create_emergency_checkpoint_manager", standalone)
    if hasattr(emergency, "create_replicator_checkpoint_manager"):
      _set(emergency, "create_replicator_checkpoint_manager", managed)
  if not drives_emergency:  # older MaxText: its functions know only Orbax's classes
    for name in ("load_state_if_possible", "maybe_save_checkpoint", "save_checkpoint"):
      original = getattr(ckpt, name)
      if not getattr(original, _PATCHED, False):
        setattr(ckpt, name, _dispatching(original, getattr(checkpointing, name)))
  else:  # MaxText's emergency save and restore leave the grain iterator out: carry it there
    for name, iterator_of in (("save_checkpoint", _saved_iterator),
                              ("load_state_if_possible", _restored_iterator)):
      _set(ckpt, name, _carrying_iterator(getattr(ckpt, name), iterator_of))
    for name in ("save", "restore"):
      _set(emergency, name, _emergency_with_iterator(getattr(emergency, name)))
  _set(train_utils, factory_holder, _with_config(getattr(train_utils, factory_holder)))
  if hasattr(max_utils, "initialize_multi_tier_checkpointing"):
    _set(max_utils, "initialize_multi_tier_checkpointing",
         _marked(_initialize_multi_tier_checkpointing))
  if hasattr(max_utils, "initialize_jax_for_tpu_with_emergency_checkpointing"):
    original = max_utils.initialize_jax_for_tpu_with_emergency_checkpointing
    _set(max_utils, "initialize_jax_for_tpu_with_emergency_checkpointing",
         _tpu_emergency_init(original))
  if drives_emergency and hasattr(ckpt, "ocp") and not isinstance(ckpt.ocp, _EmergencySteps):
    ckpt.ocp = _EmergencySteps(ckpt.ocp)
  _register_as_emergency_manager()
  _installed = version or "unknown"
  return version


def _maxtext_layout() -> Callable[[Any], Any]:
  """MaxText's on-disk layout of a train state (`train_state_nnx.to_checkpoint_dict` for an
  NNX state; a Linen state as it is), what its emergency save writes."""
  train_state_nnx = _import("maxtext.common.train_state_nnx")
  _require(train_state_nnx, "to_checkpoint_dict")
  from flax import nnx

  def layout(state: Any) -> Any:
    return train_state_nnx.to_checkpoint_dict(state) if isinstance(state, nnx.State) else state

  return layout


_EMERGENCY_ITEM = "state"  # the item emergency managers (Orbax's and ours) save the state as
_STANDARD_ITEM = "items"  # the item MaxText's standard manager saves it as


class _EmergencySteps:
  """Orbax v1's API as MaxText's checkpointing module uses it, where `load` and `metadata`
  also read a step written by an emergency manager (orbax-mtc's backups, Orbax's own).

  Why: `load_parameters_path` / `load_full_state_path` name a step (`.../<step>` or
  `.../<step>/items`) and MaxText reads its `items` item, or else the folder itself as one
  PyTree. An emergency step holds the same tree as item `state`, so `.../<step>` and
  `.../<step>/state` are read as that item; any other path is passed on unchanged.
  """

  def __init__(self, ocp_v1: Any):
    self._ocp = ocp_v1

  def __getattr__(self, name: str) -> Any:
    return getattr(self._ocp, name)

  @staticmethod
  def _resolve(path: Any, checkpointable_name: Any) -> tuple[Any, Any]:
    if checkpointable_name is not None:
      return path, checkpointable_name
    from etils import epath

    folder = epath.Path(path)
    if folder.name == _EMERGENCY_ITEM and (folder.parent / "_CHECKPOINT_METADATA").exists():
      return folder.parent, _EMERGENCY_ITEM
    if (folder / _EMERGENCY_ITEM).is_dir() and not (folder / _STANDARD_ITEM).exists():
      return folder, _EMERGENCY_ITEM
    return path, checkpointable_name

  # Only an explicit checkpointable_name=None ("the folder is the PyTree") is resolved; a
  # call without one keeps Orbax's own default.
  def load(self, path: Any, *args: Any, **kwargs: Any) -> Any:
    if "checkpointable_name" in kwargs:
      path, kwargs["checkpointable_name"] = self._resolve(path, kwargs["checkpointable_name"])
    return self._ocp.load(path, *args, **kwargs)

  def metadata(self, path: Any, *args: Any, **kwargs: Any) -> Any:
    if "checkpointable_name" in kwargs:
      path, kwargs["checkpointable_name"] = self._resolve(path, kwargs["checkpointable_name"])
    return self._ocp.metadata(path, *args, **kwargs)


def _register_as_emergency_manager() -> None:
  """MaxText's state setup (`maxtext_utils.setup_initial_state`) takes a restored state as is
  only for Orbax's emergency managers (`isinstance`); register orbax-mtc's class there, so it
  gets `load_state_if_possible`'s emergency-manager result unchanged."""
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency_manager

  import orbax_mtc

  if not issubclass(orbax_mtc.CheckpointManager, emergency_manager.CheckpointManager):
    emergency_manager.CheckpointManager.register(orbax_mtc.CheckpointManager)
