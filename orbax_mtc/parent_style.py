"""The parent-style form: `CheckpointManager(directory, options=ocp.CheckpointManagerOptions())`.

`orbax_mtc.CheckpointManager(...)` called with `ocp.CheckpointManager`'s signature builds a
`ParentStyleCheckpointManager` (the form is chosen once, from the arguments, by
`constructor.bind`). It behaves exactly as the parent on `directory`. Keyword-only
`local_directory=` (or the `ORBAX_MTC_PARENT_STYLE_LOCAL_ROOT` environment variable) adds a
RAM tier in front:

- `save` is the parent's save, unchanged; the RAM tier then keeps a copy of each step the
  parent saved (default), or saves on its own schedule (`local_options`). Items the RAM tier
  cannot hold go to `directory` only.
- `restore` comes from RAM when the args say exactly what to build (arrays with shardings, no
  per-leaf options) and every process holds the step; otherwise it is the parent's restore.
- Preemption stays the parent's (JAX's sync point); `options` are the parent's.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from orbax_mtc import constructor, item_args
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.manager import CheckpointManager
from orbax_mtc.options import CheckpointManagerOptions, LocalCheckpointOptions, ReplicationOptions
from orbax_mtc.persistent import persistent_view_when_nested

_RESTORE_FOR_SAVE = {ocp.args.PyTreeSave: ocp.args.PyTreeRestore,
                     ocp.args.StandardSave: ocp.args.StandardRestore,
                     ocp.args.JsonSave: ocp.args.JsonRestore}


def check_ram_savable(args: Any) -> None:
  """Raises TypeError unless the RAM tier holds these save args exactly as the parent would
  save them (no per-leaf save options such as a dtype cast)."""
  if args is None:
    raise TypeError("saved without args (legacy `items`)")
  for item in item_args.named_items(args).values():
    if isinstance(item, item_args.PYTREE_SAVE) and item.save_args is not None:
      raise TypeError(f"{type(item).__name__} with save_args")


def _saved_leaf(restore_arg: Any) -> local_read.SavedLeaf | None:
  """The RAM-tier target for one Orbax `ArrayRestoreArgs` that only says where the array
  goes (no dtype cast, no reshape); None for anything else."""
  if type(restore_arg) is not ocp.ArrayRestoreArgs or restore_arg.restore_type is not jax.Array:
    return None
  if restore_arg.dtype is not None or restore_arg.global_shape is not None or \
      restore_arg.shape is not None:
    return None
  sharding = restore_arg.sharding
  if sharding is None and restore_arg.mesh is not None and restore_arg.mesh_axes is not None:
    sharding = jax.sharding.NamedSharding(restore_arg.mesh, restore_arg.mesh_axes)
  return local_read.SavedLeaf(sharding) if isinstance(sharding, jax.sharding.Sharding) else None


def _ram_target(item: Any) -> Any:
  """The RAM-tier target tree for one restore item, or None when the RAM tier cannot build
  exactly what the parent would (per-leaf options, numpy or scalar leaves, transforms,
  partial restores)."""
  if isinstance(item, ocp.args.PyTreeRestore):
    if item.transforms is not None or item.legacy_transform_fn is not None or \
        item.partial_restore:
      return None
    if item.restore_args is not None:
      if item.item is not None:
        return None
      leaves, treedef = jax.tree_util.tree_flatten(item.restore_args)
      targets = [_saved_leaf(leaf) for leaf in leaves]
      if not leaves or any(t is None for t in targets):
        return None
      return jax.tree_util.tree_unflatten(treedef, targets)
  elif isinstance(item, ocp.args.StandardRestore):
    if item.fallback_sharding is not None or item.support_layout:
      return None
  else:
    return None
  leaves = jax.tree_util.tree_leaves(item.item)
  if item.item is None or not leaves or not all(item_args.is_array_target(x) for x in leaves):
    return None
  return item.item


def ram_restore_args(args: Any, saved_with: dict[str, type]) -> Any:
  """Restore args rewritten for the RAM tier (targets spelled out), or None.

  Args:
    args: the caller's restore args.
    saved_with: item name -> save args type this manager used; the parent refuses to restore
      an item with the other family's args (its handler is registered by then), so do we.
  """
  rewritten = {}
  for name, item in item_args.named_items(args).items():
    expected = _RESTORE_FOR_SAVE.get(saved_with.get(name))
    if expected is not None and type(item) is not expected:
      return None
    if isinstance(item, ocp.args.JsonRestore) and isinstance(args, ocp.args.Composite):
      rewritten[name] = item
      continue
    target = _ram_target(item)
    if target is None:
      return None
    rewritten[name] = ocp.args.PyTreeRestore(item=target)
  if not rewritten:
    return None
  if isinstance(args, ocp.args.Composite):
    return ocp.args.Composite(**rewritten)
  return rewritten[item_args.DEFAULT_ITEM]


class ParentStyleCheckpointManager(CheckpointManager):
  """`orbax_mtc.CheckpointManager` built with `ocp.CheckpointManager`'s signature."""

  _OWNS_SIGTERM = False  # the parent's preemption handling (JAX's sync point)

  def __init__(self, *args: Any, **kwargs: Any):
    """See `CheckpointManager.__init__` (the parent-style form).

    Raises:
      TypeError: options that are not `ocp.CheckpointManagerOptions`, or a mesh that is not
        a `jax.sharding.Mesh`.
      ValueError: RAM-tier arguments without a RAM tier, or with legacy checkpointers.
    """
    self._view = threading.local()
    form, params = constructor.bind(args, kwargs, CheckpointManagerOptions)
    if form != constructor.PARENT_STYLE:
      raise TypeError("ParentStyleCheckpointManager takes ocp.CheckpointManager's arguments; "
                      "build the multi-tier form with orbax_mtc.CheckpointManager(...).")
    self._init_parent_style(**params)

  def _init_parent_style(self, directory, checkpointers, options, metadata, item_names,
                         item_handlers, logger, handler_registry, local_directory, global_mesh,
                         abstract_state, local_options, replication_options, job_name) -> None:
    parent_args = (directory, checkpointers, options, metadata, item_names, item_handlers,
                   logger, handler_registry)
    if options is not None and not isinstance(options, ocp.CheckpointManagerOptions):
      raise TypeError(
          "The parent-style form takes options=ocp.CheckpointManagerOptions(...), got "
          f"{type(options).__module__}.{type(options).__name__}. For orbax_mtc options use "
          "CheckpointManager(local_directory, persistent_directory, global_mesh, "
          "abstract_state, options=...).")
    tier_extras = {"global_mesh": global_mesh, "abstract_state": abstract_state,
                   "local_options": local_options, "replication_options": replication_options,
                   "job_name": job_name}
    from_env = False
    if local_directory is None:
      local_directory = constructor.local_directory_from_env(directory, jax.process_index())
      from_env = local_directory is not None
      if from_env and checkpointers is not None:
        # Legacy Checkpointer objects save through their own handlers: leave them one tier.
        logging.info("orbax-mtc: %s is set, but this manager uses legacy checkpointers: "
                     "no RAM tier for %s", constructor.LOCAL_ROOT_ENV, directory)
        local_directory = None
    if local_directory is None:
      given = sorted(k for k, v in tier_extras.items() if v is not None)
      if given:
        raise ValueError(f"{', '.join(given)} only apply to a RAM tier: pass local_directory= "
                         "too, or drop them.")
      ocp.CheckpointManager.__init__(self, *parent_args)  # exactly the parent
      return
    if checkpointers is not None:
      raise ValueError(
          "A RAM tier (local_directory=) cannot be combined with legacy `checkpointers`: "
          "build the manager with item_names= / item_handlers= / handler_registry= and save "
          "with args=ocp.args.Composite(...), as Orbax recommends.")
    if global_mesh is not None and not isinstance(global_mesh, jax.sharding.Mesh):
      raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
    parent_options = options or ocp.CheckpointManagerOptions()
    if parent_options.read_only:
      local_options = local_options or LocalCheckpointOptions(read_only=True)
    mtc_options = CheckpointManagerOptions(
        local=local_options or LocalCheckpointOptions(max_to_keep=1),
        replication=replication_options or ReplicationOptions(),
        job_name=job_name or "orbax",
        # Not Orbax's index 0: a parent-style mesh need not have replicas first ("data").
        replica_axis_index=None,
        enable_async_checkpointing=parent_options.enable_async_checkpointing,
        async_options=parent_options.async_options,
        cleanup_tmp_directories=parent_options.cleanup_tmp_directories)
    # Without its own schedule the RAM tier keeps a copy of each step the parent saves.
    self._mirror_parent_saves = local_options is None
    self._saved_with: dict[str, type] = {}
    self._warned: set[str] = set()
    # A mesh without a data axis cannot name its replicas; when no one asked for peers
    # (a harness, or no replication_options), the RAM tier then works without them.
    self._open(local_directory, directory, mtc_options, abstract_state, backup_policy=None,
               peers_optional=from_env or replication_options is None)
    if global_mesh is not None:
      self._peers.set_mesh(global_mesh)
    with self._persistent_view():
      ocp.CheckpointManager.__init__(self, *parent_args)
    self._ready()
    self._ledger.agree_steps("starting the checkpoint manager")
    self._tiers.list_elastic_steps()  # steps saved on another process count, rebuilt from RAM

  @property
  def options(self) -> ocp.CheckpointManagerOptions:
    """The parent's options."""
    return self._options

  def reached_preemption(self, step: int) -> bool:
    """The parent's meaning (JAX's sync point)."""
    return ocp.CheckpointManager.reached_preemption(self, step)

  def _orbax_says(self, step: int) -> bool:
    with self._persistent_view():
      return bool(ocp.CheckpointManager.should_save(self, step))

  @persistent_view_when_nested
  def should_save(self, step: int) -> bool:
    if self.reached_preemption(step):
      return True
    if self._mirror_parent_saves:
      return self._orbax_says(step)
    return self._schedule.ram_due(step) or self._orbax_says(step)

  @persistent_view_when_nested
  def all_steps(self, read: bool = False) -> list[int]:
    if self._mirror_parent_saves:
      # The RAM tier holds copies of the parent's steps: the parent's list is the list.
      with self._persistent_view():
        return list(ocp.CheckpointManager.all_steps(self, read))
    return super().all_steps(read)

  @persistent_view_when_nested
  def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
           force: bool | None = False, args: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """The parent's save on `directory`, unchanged; then the RAM tier, on its own schedule or
    (default) for each step the parent saved. Items the RAM tier cannot hold go to
    `directory` only."""
    with self._persistent_view():
      ocp.CheckpointManager.check_for_errors(self)  # a failed RAM write travels in agreements
    self._peers.progress(block=False)
    with self._persistent_view():
      parent_saved = ocp.CheckpointManager.save(
          self, step, items=items, save_kwargs=save_kwargs, metrics=metrics, force=force,
          args=args, custom_metadata=custom_metadata)
    step = int(step)
    if args is not None:
      self._saved_with.update({name: type(item)
                               for name, item in item_args.named_items(args).items()})
    if self._mirror_parent_saves:
      self._drop_steps_parent_removed()
    if self._mtc_options.local.read_only or step in self._ledger.ram:
      return parent_saved
    if self._mirror_parent_saves:
      ram_due = parent_saved
    else:
      ram_due = bool(force) or self.reached_preemption(step) or self._schedule.ram_due(step)
    if not ram_due:
      return parent_saved
    try:
      check_ram_savable(args)
      # Per-process values are encoded (and their errors agreed) by the RAM save itself.
      trees = item_args.split_save_args(args, on_process_error=lambda _: None)[0]
    except TypeError as e:
      self._warn_once("ram-args", "orbax-mtc: the RAM tier keeps PyTreeSave/StandardSave/JsonSave "
                      "items only; step %d and others like it go to %s alone (%s).", step,
                      self.directory, e)
      return parent_saved
    self._mesh_from(trees)
    try:
      self._ram.save(step, args, parent_saved=True)
    except TypeError as e:  # a leaf the RAM tier cannot hold (the same on every process)
      self._warn_once("ram-leaf", "orbax-mtc: step %d goes to %s alone: %s", step,
                      self.directory, e)
      return parent_saved
    return True

  def _drop_steps_parent_removed(self) -> None:
    """Mirror mode: a step the parent's retention (or a delete) removed leaves RAM too."""
    kept = set(self._persistent.steps())
    replicating = self._peers.pending_step
    if replicating is not None and replicating not in kept:
      # Its copies must be out before its folder goes (the parent's list is the same on
      # every process: Orbax agrees it, so every process issues this collective).
      self._peers.progress(block=True)
    gone = [s for s in self._local.steps() if s not in kept]
    self._ledger.keep_ram(lambda s: s in kept)
    if not gone:
      return
    self._writer.wait()  # no write in flight while folders go (LKG link included)
    self._delete_local(gone)

  def _warn_once(self, key: str, message: str, *args: Any) -> None:
    if key not in self._warned:
      self._warned.add(key)
      logging.warning(message, *args)

  def _mesh_from(self, trees: dict[str, Any]) -> None:
    """Without global_mesh: the mesh of the first sharded leaf."""
    if self._peers.mesh is not None:
      return
    for tree in trees.values():
      for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh):
          self._peers.set_mesh(mesh)
          return

  @persistent_view_when_nested
  def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
              directory: epath.PathLike | None = None, args: Any = None) -> Any:
    """RAM first when the args say what to build and every process holds the step; otherwise
    exactly the parent's restore of `directory`."""
    # Only args that say exactly what to build (arrays with shardings, no per-leaf restore
    # options) can come from RAM; the parent serves everything else as it always did.
    single_mode = not isinstance(args, ocp.args.Composite)
    ram_args = ram_restore_args(args, self._saved_with) if directory is None else None
    if ram_args is not None and self._default_item.get() in (None, single_mode):
      targets, single = item_args.restore_targets(ram_args, self._abstract_state)
      self._writer.wait()
      self._mesh_from(targets)
      try:
        found, value = self._tiers.ram_only(step, targets, single)
      except local_format.AbstractStateMismatchError as e:
        # The parent decides what a different target means (partial restore, casting...).
        logging.info("orbax-mtc: RAM copy does not match the restore target (%s); restoring "
                     "from %s", e, self.directory)
      else:
        if found:
          self._default_item.set_if_none(single_mode)
          return value
    with self._persistent_view():
      return ocp.CheckpointManager.restore(self, step, items=items,
                                           restore_kwargs=restore_kwargs, directory=directory,
                                           args=args)

  def _finish_all(self, what: str, *, report_backup: bool = False) -> None:
    del report_backup  # the parent reports its own errors
    self._writer.wait()
    self._peers.finish()
    self._ledger.agree_steps(what)
    with self._persistent_view():
      ocp.CheckpointManager.wait_until_finished(self)

  @persistent_view_when_nested
  def check_for_errors(self):
    with self._persistent_view():
      ocp.CheckpointManager.check_for_errors(self)
