"""`PaxCheckpointManager`: the interface of Pax's `OrbaxCheckpointManager`, on orbax-mtc tiers.

Pax's training checkpointer drives a manager with `save(step, train_state, ...)`,
`restore(step, train_state, ...)`, `should_save`, `reached_preemption`, `all_steps`,
`latest_step`, `check_for_errors`, `wait_until_finished` and `close` (paxml/checkpoint_managers.py).
This class offers the same calls on top of `orbax_mtc.CheckpointManager`: a RAM tier in
`local_directory` every `local_save_interval_steps`, copies on peers, and the persistent tier in
Pax's checkpoint folder on Pax's own schedule (`save_interval_steps`, `max_to_keep`,
`keep_time_interval`).

The persistent tier keeps Pax's layout so that Pax's tools read it: step folders
`checkpoint_%08d`, items `state` (the train state, a standard Orbax PyTree checkpoint in OCDBT
format) and `metadata` (JSON with Pax's checkpoint `version` 1.2, the OCDBT one, and the
unpadded shapes of `mdl_vars`). Pax reads these with `--tensorstore_use_ocdbt=1`.

Pax builds its checkpointer before its partitioner, so neither the mesh nor the train state's
shardings are known at construction: the orbax-mtc manager is built at the first `save` or
`restore` (every process makes these calls at the same point). Until then `all_steps` reads the
folders.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

import orbax_mtc
from orbax_mtc.local import store as local_store

# As paxml/checkpoint_paths.py names step folders and items.
CHECKPOINT_PREFIX = "checkpoint"
STEP_FORMAT_FIXED_LENGTH = 8
STATE_ITEM_NAME = "state"
METADATA_ITEM_NAME = "metadata"
# paxml/checkpoint_version.py: 1.2 = the state item is in TensorStore's OCDBT format, which is
# what Orbax writes by default.
PAX_CHECKPOINT_VERSION = 1.2


def step_name_format() -> ocp.path.step.NameFormat:
  """Orbax naming that gives Pax's `checkpoint_00001234` step folders.

  Returns:
    The Orbax `NameFormat`.
  """
  return ocp.path.step.standard_name_format(step_prefix=CHECKPOINT_PREFIX,
                                            step_format_fixed_length=STEP_FORMAT_FIXED_LENGTH)


def _field(tree: Any, name: str) -> Any:
  if isinstance(tree, Mapping):
    return tree.get(name)
  return getattr(tree, name, None)


def pax_metadata(train_state: Any, unpadded: Any = None) -> dict[str, Any]:
  """The `metadata` item Pax writes beside the state (Pax's own function when installed).

  Without paxml: the same JSON layout, `{"version": 1.2, "train_state_metadata": {"mdl_vars":
  ...}}` with, per leaf, its unpadded shape and dtype.

  Args:
    train_state: The train state (arrays or `jax.ShapeDtypeStruct`s).
    unpadded: The train state's unpadded shapes and dtypes, or None to use `train_state`'s.

  Returns:
    The metadata as a JSON-serialisable dict.
  """
  try:
    from paxml import checkpoint_metadata  # type: ignore[import-not-found]
  except ImportError:
    checkpoint_metadata = None
  if checkpoint_metadata is not None:
    return dict(checkpoint_metadata.make_metadata(
        PAX_CHECKPOINT_VERSION, train_state, unpadded, tensorstore_use_ocdbt=True))
  source = unpadded if unpadded is not None else train_state
  mdl_vars = _field(source, "mdl_vars")
  tree = {"mdl_vars": mdl_vars} if mdl_vars is not None else source

  def leaf(x):
    return {"_array_metadata_tag": True, "is_optax_masked_node": False,
            "unpadded_shape": [int(d) for d in x.shape], "dtype": str(x.dtype)}

  described = jax.tree_util.tree_map(leaf, tree)
  return {"version": PAX_CHECKPOINT_VERSION,
          "train_state_metadata": ocp.utils.serialize_tree(described, keep_empty_nodes=True)}


def _abstract(tree: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, tree)


def _first_mesh(tree: Any) -> jax.sharding.Mesh | None:
  for leaf in jax.tree_util.tree_leaves(tree):
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
      return mesh
  return None


def _with_shardings(train_state: Any, specs: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """Restore targets: each leaf's own sharding, else NamedSharding(mesh, its spec)."""
  if specs is None:
    return train_state

  def target(leaf, spec):
    if getattr(leaf, "sharding", None) is not None:
      return leaf
    if mesh is None:
      raise ValueError("restore_kwargs has 'specs' but no 'mesh': pass both, as Pax does.")
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                sharding=jax.sharding.NamedSharding(mesh, spec))

  return jax.tree_util.tree_map(target, train_state, specs,
                                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


class PaxCheckpointManager:
  """Pax's `OrbaxCheckpointManager` interface backed by `orbax_mtc.CheckpointManager`.

  The orbax-mtc manager itself is built at the first `save` or `restore` (see the module
  docstring).

  Args:
    directory: Pax's checkpoint folder (`<job_log_dir>/checkpoints`): the persistent tier.
    local_directory: This process's RAM-disk folder (the RAM tier and peer copies); an
      absolute path.
    options: The persistent schedule and retention as Pax gives them (`save_interval_steps`,
      `max_to_keep`, `keep_time_interval`); None saves every step and keeps all.
    local_save_interval_steps: The RAM tier's save interval in steps.
    local_max_to_keep: RAM steps kept per node.
    peers_per_node: Nodes holding a copy of each node's RAM step (0: no copies).
    replica_axis: The data-parallel mesh axis (None: the axis named "data").
    enable_async_checkpointing: Pax's `--jax_fully_async_checkpoint`.
    async_timeout_secs: Bound on one persistent write (Pax's `--async_timeout_secs`).
    ondemand_grace_seconds: Time from SIGTERM within which the on-demand persistent backup
      may still start (Cloud TPU gives 300 s).
    job_name: First part of the `.restore` LKG links.

  Raises:
    ValueError: If `local_directory` is not absolute or is the persistent folder, or an
      option is invalid (from orbax-mtc's options classes).
    TypeError: If an option has the wrong type (from orbax-mtc's options classes).
  """

  def __init__(self, directory: epath.PathLike, *, local_directory: str | os.PathLike[str],
               options: ocp.CheckpointManagerOptions | None = None,
               local_save_interval_steps: int = 100, local_max_to_keep: int = 1,
               peers_per_node: int = 1, replica_axis: str | None = None,
               enable_async_checkpointing: bool = True, async_timeout_secs: int | None = None,
               ondemand_grace_seconds: float = 270.0, job_name: str = "pax"):
    if local_directory is None or not os.path.isabs(os.fspath(local_directory)):
      raise ValueError(f"local_directory must be an absolute path on this host's RAM disk "
                       f"(e.g. /dev/shm/pax-ckpt), got {local_directory!r}.")
    self._directory = epath.Path(directory)
    self._local_directory = Path(local_directory)
    if str(self._local_directory) == str(self._directory):
      raise ValueError("local_directory must differ from the persistent checkpoint folder "
                       f"{self._directory}.")
    self._mtc_options = orbax_mtc.CheckpointManagerOptions(
        local=orbax_mtc.LocalCheckpointOptions(save_interval_steps=local_save_interval_steps,
                                               max_to_keep=local_max_to_keep),
        persistent=_persistent_options(options),
        replication=orbax_mtc.ReplicationOptions(peers_per_node=peers_per_node,
                                                 replica_axis=replica_axis),
        job_name=job_name,
        # replica_axis None means the axis named "data" here, not Orbax's default axis 0.
        replica_axis_index=None,
        step_name_format=step_name_format(),
        enable_async_checkpointing=enable_async_checkpointing,
        async_options=None if async_timeout_secs is None else ocp.AsyncOptions(
            timeout_secs=int(async_timeout_secs)),
        # Pax's executor closes and exits itself, with its own status, once
        # `reached_preemption` says so; orbax-mtc's exit (status 0, inside save) stays off.
        exit_after_ondemand_checkpoint=False,
        ondemand_grace_seconds=ondemand_grace_seconds)
    self._manager: orbax_mtc.CheckpointManager | None = None
    self._metadata_cache: tuple[Any, dict[str, Any]] | None = None

  # ---------------------------------------------------------------- the orbax-mtc manager

  @property
  def mtc_manager(self) -> orbax_mtc.CheckpointManager | None:
    """The orbax-mtc manager (None until the first `save` or `restore`)."""
    return self._manager

  @property
  def mtc_options(self) -> orbax_mtc.CheckpointManagerOptions:
    """The options the orbax-mtc manager is (or will be) built with."""
    return self._mtc_options

  def build(self, global_mesh: jax.sharding.Mesh, abstract_state: Any
            ) -> orbax_mtc.CheckpointManager:
    """Builds the orbax-mtc manager now (collective: every process, same point).

    Args:
      global_mesh: The training mesh.
      abstract_state: The manager's abstract state (shapes, dtypes, shardings).

    Returns:
      The manager; the one already built if there is one.
    """
    if self._manager is None:
      self._manager = orbax_mtc.CheckpointManager(
          self._local_directory, self._directory, global_mesh, abstract_state,
          options=self._mtc_options)
    return self._manager

  def build_for(self, tree: Any, mesh: jax.sharding.Mesh | None = None
                ) -> orbax_mtc.CheckpointManager:
    """The orbax-mtc manager, built from a train state's shardings if not yet built.

    Args:
      tree: A train state (or restore target) whose leaves carry the shardings.
      mesh: The training mesh; None takes the mesh of the first leaf with a NamedSharding.

    Returns:
      The manager.

    Raises:
      ValueError: If the manager is not built yet and no mesh is given or found.
    """
    if self._manager is not None:
      return self._manager
    mesh = mesh or _first_mesh(tree)
    if mesh is None:
      raise ValueError("The train state has no leaf with a NamedSharding, so the global mesh "
                       "is unknown: save jax.Arrays sharded over the training mesh, or pass "
                       "restore_kwargs={'specs': ..., 'mesh': ...} as Pax does.")
    return self.build(mesh, _abstract(tree))

  # ---------------------------------------------------------------- Pax's interface

  @property
  def version(self) -> float:
    """Pax's checkpoint version of what is written (1.2: OCDBT)."""
    return PAX_CHECKPOINT_VERSION

  @property
  def directory(self) -> epath.Path:
    """The persistent tier's folder."""
    return self._directory

  @property
  def local_directory(self) -> Path:
    """This process's RAM-disk folder."""
    return self._local_directory

  def all_steps(self) -> list[int]:
    """Steps in either tier as this process sees them (no collective).

    Returns:
      The steps, oldest first.
    """
    if self._manager is not None:
      return list(self._manager.all_steps())
    steps = set(local_store.committed_steps(self._local_directory)) \
        if self._local_directory.is_dir() else set()
    if self._directory.exists():
      steps |= {m.step for m in step_name_format().find_all(self._directory)}
    return sorted(steps)

  def latest_step(self) -> int | None:
    """The newest of `all_steps()`, or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def check_for_errors(self) -> None:
    """Raises the errors of background saves, as the orbax-mtc manager's `check_for_errors`."""
    if self._manager is not None:
      self._manager.check_for_errors()

  def wait_until_finished(self) -> None:
    """Waits for the saves in flight (nothing before the manager is built)."""
    if self._manager is not None:
      self._manager.wait_until_finished()

  def reached_preemption(self, step: int) -> bool:
    """Whether `step` is the one every process saves on demand after any of them got SIGTERM.

    Args:
      step: The current step.

    Returns:
      True at that step; always False before the manager is built.
    """
    if self._manager is None:
      return False  # nothing built yet, so nothing could be saved on demand
    return self._manager.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    """True when either tier's schedule (or a preemption) asks for `step`.

    As Pax's manager: never for a step already saved (e.g. the step training resumed from),
    except on demand.

    Args:
      step: The current step.

    Returns:
      Whether `save` would write `step`.
    """
    if self._manager is None:
      latest = self.latest_step()
      return latest is None or (latest < step and (
          step % self._mtc_options.local.save_interval_steps == 0
          or step % (self._mtc_options.persistent.save_interval_steps or 1) == 0))
    if self._manager.reached_preemption(step):
      return True
    return step not in self._manager.all_steps() and self._manager.should_save(step)

  def _save_args(self, train_state: Any, unpadded: Any,
                 aux_items: Mapping[str, Any] | None) -> ocp.args.Composite:
    key = (jax.tree_util.tree_structure(train_state),
           tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(
               train_state if unpadded is None else unpadded)))
    if self._metadata_cache is None or self._metadata_cache[0] != key:
      self._metadata_cache = (key, pax_metadata(train_state, unpadded))
    items: dict[str, Any] = {
        STATE_ITEM_NAME: ocp.args.PyTreeSave(train_state),
        METADATA_ITEM_NAME: ocp.args.JsonSave(self._metadata_cache[1]),
    }
    for name, value in (aux_items or {}).items():
      if name in items:
        raise ValueError(f"aux item {name!r} clashes with Pax's own item names "
                         f"({STATE_ITEM_NAME!r}, {METADATA_ITEM_NAME!r}).")
      items[name] = ocp.args.PyTreeSave(value)
    return ocp.args.Composite(**items)

  def save(self, step: int, train_state: Any,
           train_state_unpadded_shape_dtype_struct: Any = None,
           train_input_pipeline: Any = None, force: bool | None = False,
           aux_items: dict[str, Any] | None = None) -> bool:
    """Saves `step` to the tiers that are due (all with `force`, or on demand).

    Builds the orbax-mtc manager from `train_state`'s shardings on the first call.

    Args:
      step: The step.
      train_state: The train state (jax.Arrays sharded over the training mesh).
      train_state_unpadded_shape_dtype_struct: Unpadded shapes and dtypes for the metadata
        item, or None.
      train_input_pipeline: Must be None: the input pipeline is not checkpointed.
      force: Save to every tier regardless of the schedules.
      aux_items: Extra PyTree items, by name.

    Returns:
      True when the manager saved.

    Raises:
      ValueError: If `train_input_pipeline` is given, an aux item uses Pax's own item names,
        or the manager cannot be built (no mesh found).
    """
    if train_input_pipeline is not None:
      raise ValueError(
          "pax_patch does not checkpoint the input pipeline (the RAM tier holds arrays and "
          "JSON only): set task.train.enable_input_checkpointing=False.")
    manager = self.build_for(train_state)
    args = self._save_args(train_state, train_state_unpadded_shape_dtype_struct, aux_items)
    return bool(manager.save(step, args=args, force=force))

  def restore(self, step: int | None, train_state: Any,
              train_state_unpadded_shape_dtype_struct: Any = None,
              train_input_pipeline: Any = None, restore_kwargs: Mapping[str, Any] | None = None,
              aux_items: dict[str, Any] | None = None,
              aux_restore_kwargs: dict[str, Any] | None = None) -> Any:
    """Restores `step` (None: the newest step the whole job can assemble, RAM first).

    Args:
      step: The step; None for the newest step the whole job can assemble.
      train_state: The target (abstract or concrete arrays).
      train_state_unpadded_shape_dtype_struct: Unpadded shapes and dtypes to check the saved
        metadata against, or None.
      train_input_pipeline: Must be None: the input pipeline is not checkpointed.
      restore_kwargs: May carry Pax's `specs` and `mesh` for targets without shardings;
        `transforms` must be None.
      aux_items: Extra PyTree items to restore, by name (their targets).
      aux_restore_kwargs: Accepted and ignored (the targets say it all).

    Returns:
      The train state (a dict of items when `aux_items` are given), or None when `step` is
      None and nothing is saved.

    Raises:
      ValueError: If `train_input_pipeline` or restore transforms are given, `specs` come
        without `mesh`, no mesh is known, or the saved Pax metadata does not match the model.
    """
    del aux_restore_kwargs  # per-item options of Pax's legacy handlers; targets say it all
    if train_input_pipeline is not None:
      raise ValueError("pax_patch does not checkpoint the input pipeline: set "
                       "task.train.enable_input_checkpointing=False.")
    restore_kwargs = dict(restore_kwargs or {})
    if restore_kwargs.get("transforms") is not None:
      raise ValueError("pax_patch cannot apply restore_transformations (the RAM tier restores "
                       "the saved tree as it is); unset task.train.restore_transformations.")
    mesh = restore_kwargs.get("mesh")
    target = _with_shardings(train_state, restore_kwargs.get("specs"), mesh)
    manager = self.build_for(target, mesh)
    items: dict[str, Any] = {
        STATE_ITEM_NAME: ocp.args.PyTreeRestore(item=target),
        METADATA_ITEM_NAME: ocp.args.JsonRestore(),
    }
    for name, value in (aux_items or {}).items():
      items[name] = ocp.args.PyTreeRestore(item=_abstract(value))
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    if restored is None:
      return None
    self._check_metadata(restored[METADATA_ITEM_NAME], target,
                         train_state_unpadded_shape_dtype_struct)
    if aux_items:
      return {name: restored[name] for name in items}
    return restored[STATE_ITEM_NAME]

  def _check_metadata(self, saved: Any, target: Any, unpadded: Any) -> None:
    """As Pax: the saved unpadded shapes and dtypes must be those of the current model."""
    if not isinstance(saved, Mapping) or "train_state_metadata" not in saved:
      return
    # Through JSON as the saved copy went (tuples become lists).
    expected = json.loads(json.dumps(pax_metadata(target, unpadded)))
    if saved["train_state_metadata"] != expected["train_state_metadata"]:
      raise ValueError(
          f"The checkpoint's Pax metadata does not match the model being restored: saved "
          f"{saved['train_state_metadata']}, expected {expected['train_state_metadata']}.")

  @property
  def last_restore(self) -> orbax_mtc.RestoreInfo | None:
    """The orbax-mtc manager's `last_restore`; None before the manager is built."""
    return None if self._manager is None else self._manager.last_restore

  @property
  def last_ondemand(self) -> orbax_mtc.OnDemandSave | None:
    """The orbax-mtc manager's `last_ondemand`; None before the manager is built."""
    return None if self._manager is None else self._manager.last_ondemand

  def close(self) -> None:
    """Closes the orbax-mtc manager, if built."""
    if self._manager is not None:
      self._manager.close()


def _persistent_options(options: ocp.CheckpointManagerOptions | None
                        ) -> orbax_mtc.PersistentCheckpointOptions:
  """Pax's persistent schedule and retention as orbax-mtc options."""
  if options is None:
    return orbax_mtc.PersistentCheckpointOptions(save_interval_steps=1)
  # Pax saves every step when the interval is 0 or unset.
  interval = options.save_interval_steps or 1
  keep_time: datetime.timedelta | None = getattr(options, "keep_time_interval", None)
  # With max_to_keep None every step is kept anyway (Orbax's meaning).
  if keep_time is not None and options.max_to_keep is not None:
    kept = [policies.LatestN(options.max_to_keep),
            policies.EveryNSeconds(int(keep_time.total_seconds()))]
    if options.keep_period is not None:
      kept.append(policies.EveryNSteps(options.keep_period))
    return orbax_mtc.PersistentCheckpointOptions(
        save_interval_steps=interval,
        preservation_policy=policies.AnyPreservationPolicy(kept))
  return orbax_mtc.PersistentCheckpointOptions(
      save_interval_steps=interval, max_to_keep=options.max_to_keep,
      keep_period=options.keep_period)


def log_layout(manager: PaxCheckpointManager) -> None:
  """Logs where and how often each tier of `manager` saves.

  Args:
    manager: The manager.
  """
  logging.info("pax_patch: RAM tier %s (every %d steps), persistent %s (every %s steps, Pax "
               "layout checkpoint_%%08d)", manager.local_directory,
               manager.mtc_options.local.save_interval_steps, manager.directory,
               manager.mtc_options.persistent.save_interval_steps)
