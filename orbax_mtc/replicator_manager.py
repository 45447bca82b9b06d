"""`ReplicatorCheckpointManager`: Orbax's replicator manager (GKE multi-tier checkpointing) with
Orbax's signature, over `orbax_mtc.CheckpointManager` in managed mode.

A user of `orbax.checkpoint.experimental.emergency.replicator_checkpoint_manager` switches by
changing the import. Meanings kept from Orbax (0.12.8):
- `save`/`restore` take `ocp.args.Composite` with a `state` item (`process_metadata` is
  reserved). Items go to the RAM tier, which the replicator copies and backs up; a `dataset`
  item (non-replicated state such as a data iterator) goes to `persistent_directory`, a plain
  Orbax checkpoint, at the same step; `restore` returns a `Composite`.
- `directory` is the local directory; `best_step` and `metrics` raise NotImplementedError.
Where ours differs (also in docs/api.md): the steps and `restore(None)` are agreed by every
process (the replicator's restore entry first); a RAM target needs
`PyTreeRestore(item=abstract_tree)` or `restore_args` with shardings (no inference from the
saved metadata); the RAM tier keeps the newest 1 step unless `preservation_policy=LatestN(n)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath, epy
from orbax.checkpoint import abstract_checkpoint_manager

from orbax_mtc.item_args import RESERVED_ITEM as PROCESS_METADATA_ITEM
from orbax_mtc.item_args import STATE_ITEM
from orbax_mtc.local import read as local_read
from orbax_mtc.managed.replicator_options import ReplicatorCheckpointManagerOptions
from orbax_mtc.manager import CheckpointManager
from orbax_mtc.option_checks import warn_once
from orbax_mtc.options import (
  CheckpointManagerOptions,
  LocalCheckpointOptions,
  PersistentCheckpointOptions,
  ReplicationOptions,
)
from orbax_mtc.orbax_options import as_ours
from orbax_mtc.persistent.non_replicated import DATASET_ITEM
from orbax_mtc.persistent.tier import AgreedPreemptionManager

# The managed manager underneath needs a persistent folder of its own; it writes nothing there
# (the replicator backs up), so it is an empty folder in the local directory.
UNUSED_PERSISTENT_FOLDER = ".orbax-mtc-persistent"
# Orbax's `initialize_multi_tier_checkpointing` default, for a handshake made by the manager.
DEFAULT_BACKUP_INTERVAL_MINUTES = 30


def _manager_options(options: ReplicatorCheckpointManagerOptions,
                     mtc_options: CheckpointManagerOptions | None,
                     mesh: jax.sharding.Mesh) -> CheckpointManagerOptions:
  """The managed-mode options: the RAM schedule from `options`, the rest from `mtc_options`."""
  # LatestN(n) keeps n RAM steps; any other policy decides step by step (ram_retention).
  local = LocalCheckpointOptions(save_interval_steps=options.save_interval_steps,
                                 should_save_fn=options.should_save_fn,
                                 preservation_policy=options.preservation_policy)
  if mtc_options is None:
    base = CheckpointManagerOptions(
        persistent=PersistentCheckpointOptions(
            backup_interval_minutes=DEFAULT_BACKUP_INTERVAL_MINUTES),
        # Orbax's manager has no replica axis; "data" is where MaxText keeps its replicas.
        replication=ReplicationOptions(
            replica_axis="data" if "data" in mesh.axis_names else None),
        job_name=os.environ.get("JOBSET_NAME") or "orbax")
  else:
    if not isinstance(mtc_options, CheckpointManagerOptions):
      raise TypeError("mtc_options must be an orbax_mtc.CheckpointManagerOptions, got "
                      f"{type(mtc_options).__module__}.{type(mtc_options).__name__}.")
    if mtc_options.local != LocalCheckpointOptions():
      raise ValueError("ReplicatorCheckpointManager: the RAM schedule comes from options="
                       "ReplicatorCheckpointManagerOptions(save_interval_steps=..., ...); leave "
                       "mtc_options.local at its default.")
    base = mtc_options
  return dataclasses.replace(base, local=local, mode="managed",
                             enable_async_checkpointing=options.enable_async_checkpointing)


def _unused_persistent_folder(local_directory: Path) -> Path:
  """Creates (on every process, private) the managed manager's empty persistent folder."""
  folder = local_directory / UNUSED_PERSISTENT_FOLDER
  # A folder that cannot be made here is reported by the manager's own checks of the local
  # directory, with what to do.
  with contextlib.suppress(OSError):
    local_directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
  return folder


def _sharding_of(restore_arg: Any) -> jax.sharding.Sharding:
  sharding = getattr(restore_arg, "sharding", None)
  mesh, axes = getattr(restore_arg, "mesh", None), getattr(restore_arg, "mesh_axes", None)
  if sharding is None and mesh is not None and axes is not None:
    sharding = jax.sharding.NamedSharding(mesh, axes)
  if not isinstance(sharding, jax.sharding.Sharding):
    raise ValueError(f"restore_args leaf {restore_arg!r} has no sharding: the RAM tier needs "
                     "ArrayRestoreArgs(sharding=...) or PyTreeRestore(item=abstract_tree).")
  return sharding


def ram_restore_item(item: Any) -> Any:
  """`PyTreeRestore(restore_args=...)` without `item` as the RAM tier's target tree (the
  saved shapes and dtypes, placed with the given shardings); other args unchanged."""
  if not isinstance(item, ocp.args.PyTreeRestore) or item.item is not None:
    return item
  if item.restore_args is None:
    raise ValueError("The RAM tier does not infer restore targets from the saved metadata: "
                     "give PyTreeRestore(item=abstract_tree) (leaves with shardings) or "
                     "restore_args=ArrayRestoreArgs(sharding=...) per leaf.")
  targets = jax.tree.map(lambda a: local_read.SavedLeaf(_sharding_of(a)), item.restore_args,
                         is_leaf=lambda x: isinstance(x, ocp.RestoreArgs))
  return ocp.args.PyTreeRestore(item=targets)


def checked_items(args: Any) -> dict[str, Any]:
  """The items of `args`, checked as Orbax's replicator manager checks them."""
  if not isinstance(args, ocp.args.Composite):
    raise ValueError(f"Expected args must be a Composite object, but got {type(args)}.")
  if STATE_ITEM not in args.keys():
    raise ValueError(f"{STATE_ITEM} is a required key and should be specified by the user.")
  if PROCESS_METADATA_ITEM in args.keys():
    raise ValueError(f"{PROCESS_METADATA_ITEM} is a reserved key and should not be specified "
                     "by the user.")
  for item in args.values():
    if not isinstance(item, ocp.args.CheckpointArgs):
      raise TypeError(f"Expected CheckpointArgs, got {type(item).__name__}")
  return dict(args.items())


class ReplicatorCheckpointManager(abstract_checkpoint_manager.AbstractCheckpointManager,
                                  epy.ContextManager):
  """Orbax's `ReplicatorCheckpointManager`, backed by orbax-mtc's managed mode.

  local_directory: this node's RAM-disk volume, which GKE's replicator watches.
  options: `ReplicatorCheckpointManagerOptions` (Orbax's fields; Orbax's own instance is
    converted).
  global_mesh: the training mesh.
  persistent_directory: where the `dataset` item (non-replicated state) is saved, as a plain
    Orbax checkpoint; None: a `dataset` item is not saved (warned once).
  handler_registry: handlers for the items of `persistent_directory`.
  mtc_options: ours: the managed manager's other options (`job_name`, the replica axis,
    `managed` handshake timeouts); its `local` must stay default. Without it: backups every
    30 minutes, the "data" axis as the replica axis when the mesh has one, the job name from
    JOBSET_NAME. Both are used only when no `initialize_multi_tier_checkpointing` made the
    replicator handshake in this process.
  """

  def __init__(self, local_directory: epath.PathLike,
               options: ReplicatorCheckpointManagerOptions | None = None, *,
               global_mesh: jax.sharding.Mesh,
               persistent_directory: epath.PathLike | None = None,
               handler_registry: Any = None,
               mtc_options: CheckpointManagerOptions | None = None) -> None:
    # Orbax's own ReplicatorCheckpointManagerOptions are converted field for field.
    options = as_ours(ReplicatorCheckpointManagerOptions() if options is None else options,
                      ReplicatorCheckpointManagerOptions, "options")
    if options.use_colocated_python:
      raise ValueError("ReplicatorCheckpointManagerOptions(use_colocated_python=True) needs "
                       "Pathways, which orbax-mtc does not support; run one JAX process per "
                       "host with use_colocated_python=False.")
    if not isinstance(global_mesh, jax.sharding.Mesh):
      raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
    self._options = options
    self._global_mesh = global_mesh
    self._local_directory = epath.Path(local_directory)
    local = Path(os.fspath(local_directory))
    self._manager = CheckpointManager(
        local, _unused_persistent_folder(local), global_mesh, None,
        options=_manager_options(options, mtc_options, global_mesh))
    self._dataset: AgreedPreemptionManager | None = None
    if persistent_directory is not None:
      try:
        # Told the agreed preemption step (reached_preemption): Orbax's own manager would ask
        # JAX's sync point with the user's step and move the counter our step ids feed.
        self._dataset = AgreedPreemptionManager(
            persistent_directory, options=ocp.CheckpointManagerOptions(
                save_interval_steps=options.save_interval_steps,
                step_name_format=options.step_name_format,
                should_save_fn=options.should_save_fn,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix="non_replicated"),
                create=True, cleanup_tmp_directories=False, enable_background_delete=True,
                enable_async_checkpointing=options.enable_async_checkpointing,
                preservation_policy=options.preservation_policy),
            handler_registry=handler_registry)
      except BaseException:
        self._manager.close()
        raise

  # ------------------------------------------------------------------ properties

  @property
  def directory(self) -> epath.Path:
    """The local directory (as Orbax's replicator manager)."""
    return self._local_directory

  @property
  def global_mesh(self) -> jax.sharding.Mesh:
    return self._global_mesh

  @property
  def manager(self) -> CheckpointManager:
    """The `orbax_mtc.CheckpointManager` underneath (`last_restore`, `topology`, ...)."""
    return self._manager

  # ------------------------------------------------------------------ steps

  def all_steps(self, read: bool = False) -> list[int]:
    return self._manager.all_steps(read)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    raise NotImplementedError("best_step is not implemented for ReplicatorCheckpointManager.")

  def metrics(self, step: int) -> Any:
    raise NotImplementedError("metrics is not implemented for ReplicatorCheckpointManager.")

  def reload(self) -> None:
    if self._dataset is not None:
      self._dataset.reload()
    self._manager.reload()

  def reached_preemption(self, step: int) -> bool:
    reached = self._manager.reached_preemption(step)
    if reached and self._dataset is not None:
      self._dataset.preemption_step = step
    return reached

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def is_saving_in_progress(self) -> bool:
    return self._manager.is_saving_in_progress() or (
        self._dataset is not None and self._dataset.is_saving_in_progress())

  def delete(self, step: int) -> None:
    if self._dataset is not None and step in self._dataset.all_steps():
      self._dataset.delete(step)
    self._manager.delete(step)

  # ------------------------------------------------------------------ save and restore

  def save(self, step: int, args: Any, *, force: bool = False,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Saves the items to the RAM tier when due (or `force`), and `dataset` with them."""
    items = checked_items(args)
    dataset = items.pop(DATASET_ITEM, None)
    if not self._manager.save(step, args=ocp.args.Composite(**items), force=force,
                              custom_metadata=custom_metadata):
      return False
    if dataset is None:
      return True
    if self._dataset is None:
      warn_once("ReplicatorCheckpointManager.dataset",
                "orbax-mtc: the %r item is not saved: the ReplicatorCheckpointManager has no "
                "persistent_directory.", DATASET_ITEM)
      return True
    if step in self._dataset.all_steps():
      # Left by an abandoned timeline (the run restored an older step and came here again):
      # the state saved now is new, so the item saved with it must be too.
      self._dataset.delete(step)
    # Always with the state's step, whatever the plain manager's own schedule would say.
    self._dataset.save(step, args=ocp.args.Composite(**{DATASET_ITEM: dataset}), force=True,
                       custom_metadata=custom_metadata)
    return True

  def restore(self, step: int | None, args: Any) -> Any:
    """Restores `step` (None: the step the replicator's restore entry names, else the newest
    every process holds) as a Composite; FileNotFoundError when there is none."""
    items = checked_items(args)
    dataset = items.pop(DATASET_ITEM, None)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        **{name: ram_restore_item(item) for name, item in items.items()}))
    if restored is None:
      raise FileNotFoundError(f"No steps found in {self.directory}.")
    if dataset is None:
      return restored
    if self._dataset is None:
      raise ValueError(f"The {DATASET_ITEM!r} item is restored from persistent_directory, but "
                       "this ReplicatorCheckpointManager has none.")
    restored_step = self._manager.last_restore.step if step is None else step
    extra = self._dataset.restore(restored_step,
                                  args=ocp.args.Composite(**{DATASET_ITEM: dataset}))
    return ocp.args.Composite(**dict(restored.items()), **{DATASET_ITEM: extra[DATASET_ITEM]})

  def item_metadata(self, step: int) -> Any:
    return self._manager.item_metadata(step)

  def metadata(self, step: int | None = None) -> Any:
    return self._manager.metadata(step)

  # ------------------------------------------------------------------ lifecycle

  def wait_until_finished(self) -> None:
    if self._dataset is not None:
      self._dataset.wait_until_finished()
    self._manager.wait_until_finished()

  def check_for_errors(self) -> None:
    if self._dataset is not None:
      self._dataset.check_for_errors()
    self._manager.check_for_errors()

  def close(self) -> None:
    try:
      if self._dataset is not None:
        self._dataset.close()
    finally:
      self._manager.close()

  def __contextmanager__(self):
    try:
      yield self
    finally:
      self.close()
