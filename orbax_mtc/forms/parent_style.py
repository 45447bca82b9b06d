"""The parent-style form: `CheckpointManager(directory, options=ocp.CheckpointManagerOptions())`.

`orbax_mtc.CheckpointManager(...)` called with `ocp.CheckpointManager`'s signature behaves
exactly as Orbax's manager on `directory` (`OrbaxOnlyForm`). Keyword-only `local_directory=`
(or the `ORBAX_MTC_PARENT_STYLE_LOCAL_ROOT` environment variable) adds a RAM tier in front
(`ParentStyleForm`):

- `save` is Orbax's save, unchanged; the RAM tier then keeps a copy of each step Orbax saved
  (default), or saves on its own schedule (`local_options`). Items the RAM tier cannot hold
  go to `directory` only.
- `restore` comes from RAM when the args say exactly what to build (arrays with shardings, no
  per-leaf options) and every process holds the step; otherwise it is Orbax's restore.
- Preemption stays Orbax's (JAX's sync point); `options` are Orbax's.
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from orbax_mtc import item_args
from orbax_mtc.forms import arguments
from orbax_mtc.forms.multi_tier import MultiTierForm
from orbax_mtc.forms.orbax_only import OrbaxOnlyForm
from orbax_mtc.forms.parent_style_args import check_ram_savable, ram_restore_args
from orbax_mtc.local import format as local_format
from orbax_mtc.options import CheckpointManagerOptions, LocalCheckpointOptions, ReplicationOptions


def open_parent_style(directory, checkpointers, options, metadata, item_names, item_handlers,
                      logger, handler_registry, local_directory, global_mesh, abstract_state,
                      local_options, replication_options,
                      job_name) -> OrbaxOnlyForm | ParentStyleForm:
  """The parent-style form (arguments as `ocp.CheckpointManager`'s, plus the RAM tier's).

  Raises:
    TypeError: options that are not `ocp.CheckpointManagerOptions`, or a mesh that is not
      a `jax.sharding.Mesh`.
    ValueError: RAM-tier arguments without a RAM tier, or with legacy checkpointers.
  """
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
    local_directory = arguments.local_directory_from_env(directory, jax.process_index())
    from_env = local_directory is not None
    if from_env and checkpointers is not None:
      # Legacy Checkpointer objects save through their own handlers: leave them one tier.
      logging.info("orbax-mtc: %s is set, but this manager uses legacy checkpointers: "
                   "no RAM tier for %s", arguments.LOCAL_ROOT_ENV, directory)
      local_directory = None
  if local_directory is None:
    given = sorted(k for k, v in tier_extras.items() if v is not None)
    if given:
      raise ValueError(f"{', '.join(given)} only apply to a RAM tier: pass local_directory= "
                       "too, or drop them.")
    return OrbaxOnlyForm(ocp.CheckpointManager(*parent_args))  # exactly Orbax's manager
  if checkpointers is not None:
    raise ValueError(
        "A RAM tier (local_directory=) cannot be combined with legacy `checkpointers`: "
        "build the manager with item_names= / item_handlers= / handler_registry= and save "
        "with args=ocp.args.Composite(...), as Orbax recommends.")
  if global_mesh is not None and not isinstance(global_mesh, jax.sharding.Mesh):
    raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
  arguments.check_distinct(local_directory, directory)
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
  # A mesh without a data axis cannot name its replicas; when no one asked for peers
  # (a harness, or no replication_options), the RAM tier then works without them.
  form = ParentStyleForm(
      local_directory, mtc_options, abstract_state,
      orbax=lambda: ocp.CheckpointManager(*parent_args), backup_policy=None,
      peers_optional=from_env or replication_options is None, own_sigterm=False,
      mesh=global_mesh, mirror_orbax_saves=local_options is None)
  form.start()
  return form


class ParentStyleForm(MultiTierForm):
  """The RAM tier in front of Orbax's own manager, driven by Orbax's save calls.

  Args (besides MultiTierForm's):
    mirror_orbax_saves: the RAM tier keeps a copy of each step Orbax saves (no schedule of
      its own).
  """

  def __init__(self, *args: Any, mirror_orbax_saves: bool, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.mirror_orbax_saves = mirror_orbax_saves
    self._saved_with: dict[str, type] = {}
    self._warned: set[str] = set()
    # The RAM steps this manager saved and RAM still lists (the same on every process: each
    # save is agreed).
    self._ram_saved: set[int] = set()

  def start(self) -> None:
    self.ledger.agree_steps("starting the checkpoint manager")
    self.tiers.list_elastic_steps()  # steps saved on another process count, rebuilt from RAM

  @property
  def user_options(self) -> ocp.CheckpointManagerOptions:
    """Orbax's options."""
    return self.persistent.orbax_options

  def should_save(self, step: int) -> bool:
    if self.reached_preemption(step):
      return True
    orbax_says = bool(self.persistent.orbax.should_save(step))
    if self.mirror_orbax_saves:
      return orbax_says
    return orbax_says or self.schedule.ram_due(step, self.agreed_state(False))

  def all_steps(self, read: bool = False) -> list[int]:
    if self.mirror_orbax_saves:
      # The RAM tier holds copies of Orbax's steps: Orbax's list is the list.
      return self.persistent.steps(read)
    return super().all_steps(read)

  def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
           force: bool | None = False, args: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Orbax's save on `directory`, unchanged; then the RAM tier, on its own schedule or
    (default) for each step Orbax saved. Items the RAM tier cannot hold go to `directory`
    only."""
    self.persistent.check_for_errors()  # a failed RAM write travels in agreements
    self.peers.progress(block=False)
    orbax_saved = self.persistent.orbax.save(
        step, items=items, save_kwargs=save_kwargs, metrics=metrics, force=force, args=args,
        custom_metadata=custom_metadata)
    step = int(step)
    if args is not None:
      self._saved_with.update({name: type(item)
                               for name, item in item_args.named_items(args).items()})
    if self.mirror_orbax_saves:
      self._drop_steps_orbax_removed()
    # A step this manager's RAM tier saved already is not written twice (Orbax's second save
    # of it, forced). One it did not save belongs to a timeline the job left (a run before
    # this one, a step newer than the restored one): written again, or RAM kept the old
    # state under the number Orbax now holds the new one for, and a restore served it.
    if self.options.local.read_only or (step in self.ledger.ram and step in self._ram_saved):
      return orbax_saved
    if self.mirror_orbax_saves:
      ram_due = orbax_saved
    else:
      ram_due = bool(force) or self.reached_preemption(step) or self.schedule.ram_due(
          step, self.agreed_state(False))
    if not ram_due:
      return orbax_saved
    try:
      check_ram_savable(args)
      # Per-process values are encoded (and their errors agreed) by the RAM save itself.
      trees = item_args.split_save_args(args, on_process_error=lambda _: None)[0]
    except TypeError as e:
      self._warn_once("ram-args", "orbax-mtc: the RAM tier keeps PyTreeSave/StandardSave/JsonSave "
                      "items only; step %d and others like it go to %s alone (%s).", step,
                      self.directory, e)
      return orbax_saved
    self._mesh_from(trees)
    try:
      self.ram.save(step, args, parent_saved=True)
    except TypeError as e:  # a leaf the RAM tier cannot hold (the same on every process)
      self._warn_once("ram-leaf", "orbax-mtc: step %d goes to %s alone: %s", step,
                      self.directory, e)
      return orbax_saved
    # Only listed steps matter: bounded by the RAM tier's retention over a long run.
    self._ram_saved = {*(s for s in self._ram_saved if s in self.ledger.ram), step}
    return True

  def _drop_steps_orbax_removed(self) -> None:
    """Mirror mode: a step Orbax's retention (or a delete) removed leaves RAM too."""
    kept = set(self.persistent.steps())
    replicating = self.peers.pending_step
    if replicating is not None and replicating not in kept:
      # Its copies must be out before its folder goes (Orbax's list is the same on every
      # process: Orbax agrees it, so every process issues this collective).
      self.peers.progress(block=True)
    gone = [s for s in self.local.steps() if s not in kept]
    self.ledger.keep_ram(lambda s: s in kept)
    if not gone:
      return
    self.writer.wait()  # no write in flight while folders go (LKG link included)
    self._delete_local(gone)

  def _warn_once(self, key: str, message: str, *args: Any) -> None:
    if key not in self._warned:
      self._warned.add(key)
      logging.warning(message, *args)

  def _mesh_from(self, trees: dict[str, Any]) -> None:
    """Without global_mesh: the mesh of the first sharded leaf."""
    if self.peers.mesh is not None:
      return
    for tree in trees.values():
      for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh):
          self.peers.set_mesh(mesh)
          return

  def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
              directory: epath.PathLike | None = None, args: Any = None) -> Any:
    """RAM first when the args say what to build and every process holds the step; otherwise
    exactly Orbax's restore of `directory`."""
    # Only args that say exactly what to build (arrays with shardings, no per-leaf restore
    # options) can come from RAM; Orbax serves everything else as it always did.
    single_mode = not isinstance(args, ocp.args.Composite)
    ram_args = ram_restore_args(args, self._saved_with) if directory is None else None
    if ram_args is not None and self.persistent.default_item_mode() in (None, single_mode):
      targets, single = item_args.restore_targets(ram_args, self._abstract_state)
      self.writer.wait()
      self._mesh_from(targets)
      try:
        found, value = self.tiers.ram_only(step, targets, single)
      except local_format.AbstractStateMismatchError as e:
        # Orbax decides what a different target means (partial restore, casting...).
        logging.info("orbax-mtc: RAM copy does not match the restore target (%s); restoring "
                     "from %s", e, self.directory)
      else:
        if found:
          self.persistent.fix_default_item_mode(single_mode)
          return value
    restored = self.persistent.orbax.restore(step, items=items, restore_kwargs=restore_kwargs,
                                             directory=directory, args=args)
    if directory is None:
      # Orbax's restore(None) is its latest step, the one it restored on every process (its
      # listing is this form's `all_steps`).
      served = step if step is not None else self.persistent.orbax.latest_step()
      if served is not None:
        self.writer.wait()
        self.tiers.after_other_restore(served)
    return restored

  def finish_all(self, what: str, *, report_backup: bool = False) -> None:
    del report_backup  # Orbax reports its own errors
    self.writer.wait()
    self.peers.finish()
    self.ledger.agree_steps(what)
    self.persistent.wait()

  def check_for_errors(self) -> None:
    self.persistent.check_for_errors()
