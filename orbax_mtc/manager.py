"""`orbax_mtc.CheckpointManager`: an `ocp.CheckpointManager` with a RAM-disk tier in front.

The parent class *is* the persistent tier: it is constructed on `persistent_directory` with the
persistent options, so the persistent tier is a standard Orbax checkpoint written by Orbax's
own code, and every parent API keeps its meaning there. On top of it this class adds the local
tier (this node's RAM-disk folder) and decides, per step, what each tier does.

Choices where the parent's meaning needs one for two tiers (also in docs/api.md):
- `save` returns True when either tier saved; `should_save` is True when either tier would.
- `all_steps`/`latest_step` cover both tiers as seen from this process (its committed and
  in-flight local steps plus the persistent steps); they issue no collective.
- `restore(None)` takes the newest step every process holds in RAM, else the newest
  persistent step; `restore(step)` takes that step from RAM if every process has it.
- `best_step`/`metrics` rank persistent steps (where Orbax keeps metrics), and fall back to
  the local manifest for steps only in RAM.
- `delete(step)` removes the step from both tiers; `directory` is the persistent directory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc import (
  agreement,
  backup,
  collectives,
  constructor,
  distributed,
  lkg,
  local_lock,
  local_tier,
  managed,
  peer_store,
  preemption,
  replication,
  replicator,
  restore_plan,
  topology,
  transport,
)
from orbax_mtc.options import (
  CheckpointManagerOptions,
  LocalCheckpointOptions,
  ReplicationOptions,
  replica_axis_name,
)

_PYTREE_SAVE = (ocp.args.PyTreeSave, ocp.args.StandardSave)
_PYTREE_RESTORE = (ocp.args.PyTreeRestore, ocp.args.StandardRestore)
_DEFAULT_ITEM = "default"  # Orbax's folder name for a single-item checkpoint
ONDEMAND_FILE = "ondemand.json"  # in an on-demand step's local folder: its time breakdown
ONDEMAND_METADATA_KEY = "orbax_mtc_ondemand"  # in custom_metadata of the persistent step


def _persistent_view_when_nested(method):
  """Runs the parent's method instead while the parent is running inside one of ours.

  The parent's `save`/`restore`/`__init__` call `self.all_steps()`, `self.wait_until_finished()`
  and friends; inside those calls they must see the persistent tier alone.
  """
  name = method.__name__

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    # Before our __init__ completes (the parent's __init__ runs first, partly on worker
    # threads) there is only the parent.
    if not self.__dict__.get("_mtc_ready") or getattr(self._view, "persistent", False):
      return getattr(super(CheckpointManager, self), name)(*args, **kwargs)
    return method(self, *args, **kwargs)

  return wrapper


def _plain_path(key_path: Any) -> str:
  """A leaf's path with every key as Orbax stores it (attribute and dict keys alike: a
  dataclass or namedtuple is saved as a dict of its fields)."""
  parts = []
  for key in key_path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(f"[{getattr(key, attr)!r}]")
        break
    else:
      parts.append(str(key))
  return "".join(parts)


def _check_ram_savable(args: Any) -> None:
  """TypeError unless the RAM tier holds these save args exactly as the parent would save
  them (no per-leaf save options such as a dtype cast)."""
  if args is None:
    raise TypeError("saved without args (legacy `items`)")
  for item in _named_items(args).values():
    if isinstance(item, _PYTREE_SAVE) and item.save_args is not None:
      raise TypeError(f"{type(item).__name__} with save_args")


def _is_array_target(leaf: Any) -> bool:
  if isinstance(leaf, jax.Array):
    return True
  return isinstance(leaf, jax.ShapeDtypeStruct) and isinstance(
      getattr(leaf, "sharding", None), jax.sharding.Sharding)


def _saved_leaf(restore_arg: Any) -> local_tier.SavedLeaf | None:
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
  return local_tier.SavedLeaf(sharding) if isinstance(sharding, jax.sharding.Sharding) else None


def _ram_target(item: Any) -> Any:
  """The RAM-tier target tree for one parent-style restore item, or None when the RAM tier
  cannot build exactly what the parent would (per-leaf options, numpy or scalar leaves,
  transforms, partial restores)."""
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
  if item.item is None or not leaves or not all(_is_array_target(x) for x in leaves):
    return None
  return item.item


_RESTORE_FOR_SAVE = {ocp.args.PyTreeSave: ocp.args.PyTreeRestore,
                     ocp.args.StandardSave: ocp.args.StandardRestore,
                     ocp.args.JsonSave: ocp.args.JsonRestore}


def _named_items(args: Any) -> dict[str, Any]:
  """Item name -> args of one item (a single-item call is Orbax's default item)."""
  return dict(args.items()) if isinstance(args, ocp.args.Composite) else {_DEFAULT_ITEM: args}


def _ram_restore_args(args: Any, saved_with: Mapping[str, type]) -> Any:
  """Parent-style restore args rewritten for the RAM tier (targets spelled out), or None.

  `saved_with`: item name -> save args type this manager used; the parent refuses to restore
  an item with the other family's args (its handler is registered by then), so do we.
  """
  rewritten = {}
  for name, item in _named_items(args).items():
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
  return rewritten[_DEFAULT_ITEM]


@dataclasses.dataclass
class OnDemandSave:
  """The on-demand checkpoint a preemption notice triggered, and where its time went.

  seconds: "agreement" (SIGTERM to the agreed step; 0 when the signal time is unknown),
  "local", "peers", "persistent" and "total" (SIGTERM, or the agreed step, to durable).
  """

  step: int
  signal_time: float | None  # epoch seconds of the first SIGTERM of the job
  budget_seconds: float
  seconds: dict[str, float]
  persistent: bool  # backed up to the persistent tier

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass
class RestoreInfo:
  """Where the last `restore` came from (for logs, the demo and `status`)."""

  step: int | None
  tier: str  # "local" (own folder), "peer" (a twin or a peer's copy), "persistent" or "none"
  seconds: float


class CheckpointManager(ocp.CheckpointManager):
  """Multi-tier checkpointing: RAM disk every few steps, persistent Orbax checkpoint rarely.

  Usage::

    mgr = orbax_mtc.CheckpointManager(
        local_directory="/dev/shm/ckpt", persistent_directory="gs://bucket/run",
        global_mesh=mesh, abstract_state=abstract_state, options=options)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    restored = mgr.restore(None).state
  """

  def __init__(self, *args: Any, **kwargs: Any):
    """Two ways in (docs/api.md), told apart by the arguments:

    multi-tier: `CheckpointManager(local_directory, persistent_directory, global_mesh,
    abstract_state, *, options=orbax_mtc.CheckpointManagerOptions(...), metadata=None,
    logger=None, item_handlers=None, handler_registry=None)`.

    parent-style: `ocp.CheckpointManager`'s signature (`directory, checkpointers=None,
    options=None, metadata=None, item_names=None, item_handlers=None, logger=None,
    handler_registry=None`) with `ocp.CheckpointManagerOptions`; it behaves exactly as the
    parent on `directory`. Keyword-only `local_directory=` adds a RAM tier in front (with
    `global_mesh`, `abstract_state`, `local_options`, `replication_options`, `job_name`
    optional: the mesh and targets then come from the save and restore args).
    """
    self._view = threading.local()
    form, params = constructor.bind(args, kwargs, CheckpointManagerOptions)
    if form == constructor.MULTI_TIER:
      self._init_multi_tier(**params)
    else:
      self._init_parent_style(**params)

  def _init_multi_tier(self, local_directory, persistent_directory, global_mesh, abstract_state,
                       options, metadata, logger, item_handlers, handler_registry) -> None:
    options = CheckpointManagerOptions() if options is None else options
    if not isinstance(options, CheckpointManagerOptions):
      raise TypeError(
          "options must be an orbax_mtc.CheckpointManagerOptions, got "
          f"{type(options).__module__}.{type(options).__name__}. Build it with "
          "orbax_mtc.CheckpointManagerOptions(local=..., persistent=...), or use the "
          "parent-style form CheckpointManager(directory, options=ocp.CheckpointManagerOptions"
          "(...), local_directory=...).")
    if not isinstance(global_mesh, jax.sharding.Mesh):
      raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
    if local_directory is None or persistent_directory is None:
      raise ValueError("Both local_directory (RAM disk) and persistent_directory are required.")
    self._parent_style = False
    self._mirror_parent_saves = False
    self._peers_optional = False
    self._init_local_tier(local_directory, persistent_directory, options, abstract_state)
    self._set_mesh(global_mesh)
    with self._persistent_view():
      super().__init__(persistent_directory, options=options.persistent_manager_options(),
                       metadata=metadata, logger=logger, item_handlers=item_handlers,
                       handler_registry=handler_registry)
    self._init_runtime()
    if self._managed:
      self._connect_replicator()
    else:
      minutes = options.persistent.backup_interval_minutes
      if minutes is not None:
        self._backup_policy = backup.BackupIntervalPolicy(minutes)
        self._last_backup_attempt = self._newest_backup_time()
    # One answer on every process from the start (rule 8): after a node loss the replaced
    # node's own folder is empty, but the cluster can still restore from twins and peers.
    self._agree_steps("starting the checkpoint manager")

  def _connect_replicator(self) -> None:
    """Managed mode: the replicator handshake (unless `initialize_multi_tier_checkpointing`
    made it in this process), and this worker's restore entry taken into the RAM tier."""
    done, step = replicator.handshake_result(self._local.directory)
    error: Exception | None = None
    if not done:
      config = managed.config_for_manager(self._mtc_options, self._topology,
                                          self._process_index, self._process_count)
      managed_options = self._mtc_options.managed
      try:
        step = replicator.connect(self._local.directory, config, self._worker_index,
                                  timeout_s=managed_options.timeout_seconds,
                                  poll_s=managed_options.poll_seconds)
      except (replicator.ReplicatorError, TimeoutError, OSError) as e:
        error = e
    # Every process learns of a failure anywhere and stops too, instead of waiting in the
    # next collective for a process that has gone.
    records = self._agree(agreement.StartRecord(fault=agreement.Fault.of(error)),
                          "the replicator handshake")
    if error is not None:
      raise error
    failed = agreement.faults(records)
    if failed:
      raise replicator.ReplicatorError(
          f"The replicator handshake failed on process(es) {sorted(failed)}: " + "; ".join(
              f"process {p}: {f.kind}: {f.message}" for p, f in sorted(failed.items())))
    # The first restore(None) honours the entry; 0 = the replicator has nothing.
    self._replicator_entry = step or 0

  def _replicator_step(self) -> int | None:
    """The step every process's restore entry names (collective), once: 0 when all say
    nothing to restore, None when they disagree or cannot be used (then the usual plan)."""
    mine, self._replicator_entry = self._replicator_entry, None
    if mine is None:
      return None
    records = self._agree(agreement.EntryRecord(step=mine, readable=mine in self._local_steps()),
                          "the replicator's restore entries")
    steps = [r.step for r in records]
    agreed = replicator.agree(steps)
    if agreed is None:
      logging.warning("orbax-mtc: the replicator's restore entries disagree across processes "
                      "(steps %s); restoring the newest step every process holds instead.",
                      steps)
    unreadable = [p for p, r in enumerate(records) if not r.readable]
    if agreed and unreadable:
      logging.warning("orbax-mtc: the replicator named step %d but process(es) %s cannot read "
                      "it; restoring the newest step every process holds instead.", agreed,
                      unreadable)
      return None
    return agreed

  def _init_parent_style(self, directory, checkpointers, options, metadata, item_names,
                         item_handlers, logger, handler_registry, local_directory, global_mesh,
                         abstract_state, local_options, replication_options, job_name) -> None:
    self._parent_style = True
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
      super().__init__(*parent_args)  # exactly the parent: every override defers to it
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
    # A mesh without a data axis cannot name its replicas; when no one asked for peers
    # (a harness, or no replication_options), the RAM tier then works without them.
    self._peers_optional = from_env or replication_options is None
    self._init_local_tier(local_directory, directory, mtc_options, abstract_state)
    self._global_mesh = None
    if global_mesh is not None:
      self._set_mesh(global_mesh)
    with self._persistent_view():
      super().__init__(*parent_args)
    self._init_runtime()
    self._agree_steps("starting the checkpoint manager")

  def _init_local_tier(self, local_directory, persistent_directory,
                       options: CheckpointManagerOptions, abstract_state: Any) -> None:
    self._mtc_options = options
    self._abstract_state = abstract_state
    self._process_index = jax.process_index()
    self._process_count = jax.process_count()
    self._worker_index = (options.worker_index if options.worker_index is not None
                          else distributed.worker_index())
    local_path = Path(str(local_directory))
    if str(local_path) == str(persistent_directory):
      raise ValueError("local_directory and persistent_directory must be different folders.")
    self._managed = options.mode == "managed"
    modes = {"dir_mode": options.local.directory_mode, "file_mode": options.local.file_mode}
    self._local = local_tier.LocalTier(local_path, max_to_keep=options.local.max_to_keep,
                                       on_commit=self._after_local_commit,
                                       reuse_files=not self._managed,
                                       process_index=self._process_index,
                                       process_count=self._process_count, **modes)
    self._store = peer_store.PeerStore(local_path, max_to_keep=options.local.max_to_keep,
                                       **modes)
    self._claim_local_directory(local_path, options)
    self._topology: topology.Topology | None = None
    self._replicator: replication.Replicator | None = None
    self._replica_axis: str | None = None

  def _claim_local_directory(self, local_path: Path, options: CheckpointManagerOptions) -> None:
    """Claims this process's local directory (a lock naming the holder) and prepares it.
    A failure on any process (two processes given one folder, a folder that cannot be used)
    is raised on every process together, before anything in the folder is touched."""
    self._directory_lock: local_lock.LocalDirectoryLock | None = None
    error: Exception | None = None
    try:
      if local_path.exists() and not local_path.is_dir():
        raise ValueError(
            f"local_directory {local_path} exists and is not a directory. Point "
            "local_directory at a folder on the RAM disk (e.g. /dev/shm/ckpt) or remove the "
            "file.")
      existed = local_path.is_dir()
      if existed:  # before the lock file is made in it
        local_tier.check_owner(local_path, "local_directory")
      try:
        self._directory_lock = local_lock.LocalDirectoryLock.claim(
            local_path, job_name=options.job_name, process_index=self._process_index)
      except OSError as e:
        if not existed:
          raise ValueError(f"Cannot create local_directory {local_path}: {e.strerror}. Choose "
                           "a writable folder on the RAM disk (e.g. /dev/shm/ckpt).") from e
        raise ValueError(f"local_directory {local_path} is not writable by this process (uid "
                         f"{os.getuid()}): {e.strerror}. Fix its permissions or choose another "
                         "folder.") from e
      self._local.prepare()
      self._store.prepare()
      if not self._managed:
        lkg.cleanup_temporary(local_path, options.job_name, self._process_index,
                              self._worker_index)
    except (local_lock.LocalDirectoryInUseError, ValueError, OSError) as e:
      error = e
    records = self._agree(agreement.StartRecord(fault=agreement.Fault.of(error)),
                          "opening the local directory")
    failed = agreement.faults(records)
    if not failed:
      return
    if self._directory_lock is not None:
      self._directory_lock.release()
    if error is not None:
      raise error
    raise agreement.CheckpointError(
        "opening the local directory", {p: f"{f.kind}: {f.message}" for p, f in failed.items()})

  def _set_mesh(self, global_mesh: jax.sharding.Mesh) -> None:
    """Replica axis and topology from the mesh (pure: no collective, no I/O)."""
    options = self._mtc_options
    self._global_mesh = global_mesh
    try:
      self._replica_axis = replica_axis_name(options, global_mesh.axis_names,
                                             multi_process=self._process_count > 1,
                                             axis_sizes=dict(global_mesh.shape))
    except ValueError as e:
      if not self._peers_optional:
        raise
      logging.warning("orbax-mtc: RAM tier without peer copies: %s", e)
      return
    if self._process_count > 1:
      replication_options = options.replication
      self._topology = topology.build_topology(
          topology.process_grid(global_mesh), global_mesh.axis_names, self._replica_axis,
          num_processes=self._process_count,
          peers_per_node=replication_options.peers_per_node,
          peer_ranks=replication_options.peer_ranks)

  def _start_replicator(self) -> None:
    options = self._mtc_options
    if self._managed:
      return  # GKE's replicator copies the steps
    if self._topology is not None and self._topology.edges:
      self._replicator = replication.Replicator(
          self._topology, self._process_index, self._local, self._store, self._writer,
          lambda row: self._allgather(row, "the peer copies of a step"),
          chunk_bytes=options.replication.chunk_bytes,
          window=options.replication.chunks_in_flight)
      self._store.drop_sources(self._topology.held_by(self._process_index))

  def _mesh_from(self, trees: Mapping[str, Any]) -> None:
    """Parent-style form without global_mesh: the mesh of the first sharded leaf."""
    if self._global_mesh is not None:
      return
    for tree in trees.values():
      for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh):
          self._set_mesh(mesh)
          self._start_replicator()
          return

  def _init_runtime(self) -> None:
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtc-local-write")
    self._pending: concurrent.futures.Future | None = None
    self._local_error: BaseException | None = None  # not yet handed to an agreement
    self._fault_cause: BaseException | None = None  # handed, not yet raised
    # The step lists every process agreed on (rule 8): RAM steps the cluster can assemble,
    # and persistent steps every process sees. Set at start, each local save and restore.
    self._agreed_ram: tuple[int, ...] = ()
    self._agreed_persistent: tuple[int, ...] = ()
    # Only the thread that built the manager (the training loop) creates preemption ids.
    self._owner_thread = threading.current_thread()
    # The parent-style form keeps the parent's preemption handling (JAX's sync point).
    self._own_sigterm_handler = (not self._parent_style
                                 and preemption.attach(self._process_count))
    self._sync_step: int | None = None
    self.last_ondemand: OnDemandSave | None = None
    self._closed = False
    self._shard_sets_cache: tuple[Any, list] | None = None
    self._start_replicator()
    self._recovered: tuple[local_tier.StepManifest, np.ndarray] | None = None
    self.last_restore: RestoreInfo | None = None
    self.last_save_blocking_seconds: float | None = None
    # Managed mode: the step this worker's .restore entry named, until restore(None) used it.
    self._replicator_entry: int | None = None
    self._backup_policy: backup.BackupIntervalPolicy | None = None
    self._last_backup_attempt: tuple[int, float] | None = None  # (step, seconds since epoch)
    self._backup_pending: backup.PendingBackup | None = None
    self._backup_inflight: int | None = None
    self._backup_error: backup.BackupError | None = None  # newest failure, not yet reported
    # Since when a due backup waits for an earlier one still running (monotonic seconds).
    self._backup_waiting_since: float | None = None
    self._warned_backup_waiting = False
    self.last_backup: backup.BackupInfo | None = None
    # Finished backup attempts, newest last ("done" or "failed"), for monitoring.
    self.backup_history: collections.deque[backup.BackupInfo] = collections.deque(maxlen=100)
    self._mtc_ready = True
    logging.info("orbax-mtc: process %d/%d, local %s, persistent %s, replica axis %r",
                 self._process_index, self._process_count, self._local.directory,
                 self.directory, self._replica_axis)

  # ------------------------------------------------------------------ helpers

  @contextlib.contextmanager
  def _persistent_view(self):
    previous = getattr(self._view, "persistent", False)
    self._view.persistent = True
    try:
      yield
    finally:
      self._view.persistent = previous

  @property
  def local_directory(self) -> Path | None:
    """This node's RAM-tier folder (None for a parent-style manager without one)."""
    local = self.__dict__.get("_local")
    return None if local is None else local.directory

  @property
  def global_mesh(self) -> jax.sharding.Mesh | None:
    return self.__dict__.get("_global_mesh")

  @property
  def replica_axis(self) -> str | None:
    return self.__dict__.get("_replica_axis")

  @property
  def options(self) -> CheckpointManagerOptions | ocp.CheckpointManagerOptions:
    """The options the manager was built with: orbax_mtc's (multi-tier form) or the parent's
    (parent-style form)."""
    if self.__dict__.get("_parent_style"):
      return self._options
    return self._mtc_options

  @property
  def topology(self) -> topology.Topology | None:
    """Replicas, twins and peers of this job (None in a single process)."""
    return self.__dict__.get("_topology")

  def _after_local_commit(self, step: int) -> None:
    # Runs on the writer thread after the rename: file I/O only.
    if self._managed:
      return  # the replicator writes the .restore entries
    lkg.update(self._local.directory, self._mtc_options.job_name, step, self._process_index,
               self._worker_index)

  def _refresh_lkg(self) -> None:
    """Re-points the LKG link after steps were removed (main thread, no write in flight)."""
    if self._managed:
      return
    steps = self._local_steps()
    if steps:
      self._after_local_commit(steps[-1])
    else:
      lkg.remove_all(self._local.directory, self._mtc_options.job_name, self._process_index,
                     self._worker_index)

  def _persistent_steps(self) -> list[int]:
    with self._persistent_view():
      return list(super().all_steps())

  def _local_steps(self) -> list[int]:
    return self._local.steps()

  def _allgather(self, row: np.ndarray, what: str = "an agreement") -> np.ndarray:
    """Every process's `row` (a collective), after a barrier bounded by
    `agreement_timeout_seconds` that names the processes that never came."""
    return collectives.allgather(row, what, self._process_count,
                                 self._mtc_options.agreement_timeout_seconds)

  def _agree(self, record: Any, what: str) -> list[Any]:
    """Every process's record of this call (one all-gather; rule 8)."""
    return agreement.gather(record, lambda row: self._allgather(row, what))

  def _inventory(self, own_steps: list[int] | None = None,
                 persistent_steps: list[int] | None = None) -> agreement.Inventory:
    """What this node can serve now (its part of every steps agreement)."""
    own = self._local_steps() if own_steps is None else own_steps
    copies = self._store.servable(own) if self._replicator is not None else []
    persistent = self._persistent_steps() if persistent_steps is None else persistent_steps
    return agreement.Inventory.of(own, copies, persistent)

  def _listing_groups(self) -> list[int] | None:
    """Which processes hold the same shards (twins), for listing steps before any restore
    target is known: from `abstract_state` when it has shardings; else none (own folders
    and peer copies only, which never lists a step the cluster cannot assemble)."""
    if self._topology is None or self._abstract_state is None:
      return None
    cached = self.__dict__.get("_listing_groups_cache")
    if cached is not None:
      return cached
    leaves = jax.tree_util.tree_leaves(self._abstract_state)
    if not leaves or not all(_is_array_target(leaf) for leaf in leaves):
      return None
    # Computed once (the abstract state and the mesh do not change); not through
    # _shard_sets, whose one-entry cache serves the saves.
    groups = replication.shard_groups(
        replication.shard_sets({"state": self._abstract_state}, self._process_count))
    self._listing_groups_cache = groups
    return groups

  def _adopt(self, inventories: list[agreement.Inventory], *, saved: int | None = None,
             floor: int | None = None) -> list[restore_plan.NodeInventory]:
    """Takes the agreed step lists from gathered inventories (the same on every process).
    `saved`: a step every process has just started writing to RAM."""
    nodes = [restore_plan.NodeInventory(frozenset(inv.own_steps), frozenset(inv.copies))
             for inv in inventories]
    ram = restore_plan.restorable_steps(nodes, self._listing_groups())
    if saved is not None:
      ram = restore_plan.retained_steps([*ram, saved], self._mtc_options.local.max_to_keep,
                                        floor)
    self._agreed_ram = tuple(ram)
    self._agreed_persistent = agreement.agreed_persistent_steps(inventories,
                                                                self._persistent_steps())
    return nodes

  def _agree_steps(self, what: str, *, report_backup: bool = False) -> None:
    """Agrees the step lists and raises, on every process alike, the errors any process
    still holds (collective). `report_backup`: a failed newest backup is one of them."""
    fault = self._take_fault()
    backup_error = None
    if report_backup and not fault.present:
      backup_error, self._backup_error = self._backup_error, None
      if backup_error is not None:
        fault = agreement.Fault.of(backup_error.cause, backup_step=backup_error.step)
    records = self._agree(agreement.FinishRecord(fault=fault, inventory=self._inventory()),
                          what)
    self._adopt([r.inventory for r in records])
    self._raise_agreed_faults(records, what, own_backup_error=backup_error)

  def _take_fault(self) -> agreement.Fault:
    """This process's unreported error (a failed local write or write-back, an LKG or
    retention error on the writer thread), handed to the next agreement."""
    error, self._local_error = self._local_error, None
    if error is not None:
      self._fault_cause = error
    return agreement.Fault.of(error)

  def _raise_agreed_faults(self, records: list[Any], what: str, *,
                           own_backup_error: backup.BackupError | None = None) -> None:
    """The same error on every process when any reported one (rule 9): CheckpointError for
    a local fault, else BackupError for a failed backup."""
    cause, self._fault_cause = self._fault_cause, None
    found = agreement.faults(records)
    if not found:
      return
    local = {p: f for p, f in found.items() if f.backup_step < 0}
    if local:
      # This error usually ends the program: let the backup in flight finish first (every
      # process is here), or the interpreter stops under it and leaves a half-written
      # `<step>.orbax-checkpoint-tmp` behind ("cannot schedule new futures after shutdown").
      self._poll_backup(block=True)
      raise agreement.CheckpointError(
          what, {p: f"{f.kind}: {f.message}" for p, f in local.items()}) from cause
    if own_backup_error is not None:
      raise own_backup_error
    p, fault = min(found.items())
    raise backup.BackupError(fault.backup_step, RuntimeError(
        f"on process {p}: {fault.kind}: {fault.message}"))

  # ------------------------------------------------------------------ decisions

  def _local_should_save(self, step: int) -> bool:
    local = self._mtc_options.local
    if local.read_only:
      return False
    # Agreed steps only (the step being written is among them): a node whose folder was
    # wiped must answer as the others do.
    steps = list(self._agreed_ram)
    last = max(steps) if steps else None
    if last is not None and last >= step:
      return False
    if local.save_decision_policy is not None:
      infos = [ocp.checkpoint_manager.CheckpointInfo(step=s, time=None, metrics=None)  # type: ignore[arg-type]
               for s in sorted(steps)]
      # A write issued and not yet waited for: issued and waited for at agreed points.
      context = policies.DecisionContext(is_saving_in_progress=self._pending is not None,
                                         reached_preemption=False)
      current = ocp.checkpoint_manager.CheckpointInfo(step=step, time=None, metrics=None)  # type: ignore[arg-type]
      return bool(local.save_decision_policy.should_save(current, infos, context=context))
    if local.should_save_fn is not None:
      return bool(local.should_save_fn(step, last))
    return step % local.save_interval_steps == 0

  def _persistent_should_save(self, step: int) -> bool:
    if self.__dict__.get("_managed"):
      return False  # GKE's replicator backs the RAM steps up
    if self.__dict__.get("_backup_policy") is not None:
      return False  # by minutes: decided at local saves (_save_local), never per step
    if self.__dict__.get("_parent_style"):
      with self._persistent_view():
        return bool(super().should_save(step))
    attempt = self.__dict__.get("_last_backup_attempt")
    schedule = self._mtc_options.persistent
    agreed = self.__dict__.get("_agreed_persistent", ())
    if attempt is not None and schedule.save_decision_policy is None and not agreed:
      # Orbax saves the first step it is asked about; our first backup may still be on its
      # way (read from RAM, then written), so count from that attempt instead.
      if schedule.should_save_fn is not None:
        return bool(schedule.should_save_fn(step, attempt[0]))
      return step > attempt[0] and step % schedule.save_interval_steps == 0
    return self._parent_policy_says(step, agreed)

  def _parent_policy_says(self, step: int, agreed: tuple[int, ...]) -> bool:
    """Orbax's `should_save` for the persistent tier, asked with the agreed persistent steps
    instead of this process's own list (which can lag after a failed finalize)."""
    if agreed and agreed[-1] >= step:
      return False
    kept = set(agreed)
    previous = [info for info in self._checkpoints if info.step in kept]
    context = policies.DecisionContext(
        is_saving_in_progress=False, reached_preemption=self.reached_preemption(step),
        multiprocessing_options=self._multiprocessing_options)
    current = ocp.checkpoint_manager.CheckpointInfo(
        step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=None)
    return bool(self._save_decision_policy.should_save(current, previous_steps=previous,
                                                       context=context))

  @_persistent_view_when_nested
  def should_save(self, step: int) -> bool:
    if self.reached_preemption(step):
      return True
    if self._parent_style and self._mirror_parent_saves:
      return self._persistent_should_save(step)
    return self._local_should_save(step) or self._persistent_should_save(step)

  def reached_preemption(self, step: int) -> bool:
    """True at the step every process saves on after any of them got SIGTERM.

    Call it (or `save`) at every step, on every process, in the same order. Asking again
    about a step gives the same answer. Not wrapped for the parent: its internal calls (from
    `save`, `should_save` and its finalize thread) must see this answer, never ask JAX with
    the user's step.
    """
    if self.__dict__.get("_parent_style"):
      return super().reached_preemption(step)  # the parent's meaning (JAX's sync point)
    if not self.__dict__.get("_mtc_ready"):
      return False
    step = int(step)
    if threading.current_thread() is not self._owner_thread:
      return preemption.known_answer(step)
    answer = preemption.reached(step)
    if answer and self._sync_step is None:
      self._sync_step = step
      logging.warning("orbax-mtc: preemption notice: every process saves step %d on demand",
                      step)
    return answer

  def should_exit(self) -> bool:
    """True once the preemption sync step was reached: save it, then stop training."""
    return self.__dict__.get("_sync_step") is not None

  # ------------------------------------------------------------------ save

  def _split_save_args(self, args: Any) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(pytree items, json items, default_item) from Orbax save args."""
    if isinstance(args, _PYTREE_SAVE):
      return {_DEFAULT_ITEM: args.item}, {}, True
    if isinstance(args, ocp.args.Composite):
      trees, jsons = {}, {}
      for name, item in args.items():
        if isinstance(item, _PYTREE_SAVE):
          trees[name] = item.item
        elif isinstance(item, ocp.args.JsonSave):
          jsons[name] = item.item
        else:
          raise TypeError(
              f"Item {name!r}: {type(item).__name__} cannot be saved to the RAM tier, which "
              "holds PyTreeSave/StandardSave and JsonSave items. Save it with a plain "
              "ocp.CheckpointManager, or convert it to a pytree of arrays.")
      return trees, jsons, False
    raise TypeError(
        f"save() needs args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)) or "
        f"ocp.args.PyTreeSave(state) / StandardSave(state); got {type(args).__name__}.")

  @_persistent_view_when_nested
  def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
           force: bool | None = False, args: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Saves `step` to the tiers whose schedule (or `force`, or a preemption) asks for it."""
    if self._parent_style:
      return self._save_parent_style(step, items, save_kwargs, metrics, force, args,
                                     custom_metadata)
    if args is None:
      if items is None:
        raise ValueError("Must provide `args` for `save`.")
      args = items if isinstance(items, ocp.args.CheckpointArgs) else ocp.args.PyTreeSave(items)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}.")
    step = int(step)
    # An error of an earlier write is not raised here, on this process alone: it travels in
    # the next agreement, so every process raises it together (rule 9).
    self._poll_backup()
    self._replication_progress(block=False)
    preempted = self.reached_preemption(step)
    read_only = self._mtc_options.local.read_only
    # Every input below is agreed (rule 8): the same branch on every process.
    persistent_due = not self._managed and (
        force or preempted or self._persistent_should_save(step)) and (
        step not in self._agreed_persistent)
    # A backup is taken from the RAM tier, so a step due for one is saved there too.
    local_due = not read_only and (force or preempted or persistent_due
                                   or self._local_should_save(step))
    if preempted:
      if self.last_ondemand is not None and self.last_ondemand.step == step:
        return False  # already saved on demand (as Orbax: a step is saved once)
      self._save_ondemand(step, args, metrics, custom_metadata)
      return True
    if not (local_due or persistent_due):
      return False
    newest_ram = self._agreed_ram[-1] if self._agreed_ram else None
    if local_due and newest_ram is not None and step < newest_ram:
      return self._save_older_step(step, args, metrics, custom_metadata, newest_ram)
    if local_due:
      # Whether the step is already in RAM or persistent is decided there, after the save's
      # one all-gather, so that every process takes the same branch.
      self._save_local(step, args, backup_wanted=persistent_due, metrics=metrics,
                       custom_metadata=custom_metadata)
    elif persistent_due:  # no RAM tier to take it from (read_only): straight from the arrays
      self._start_backup(step, args, metrics, custom_metadata)
    return True

  def _save_older_step(self, step: int, args: Any, metrics: Any,
                       custom_metadata: dict[str, Any] | None, newest_ram: int) -> bool:
    """A forced save of a step older than the newest RAM step (Orbax allows it). RAM
    retention keeps the newest steps, so the RAM tier would retire it at once and could lose
    a newer step for it: it goes to the persistent tier only (docs/api.md)."""
    if step in self._agreed_persistent:
      raise ocp.checkpoint_manager.StepAlreadyExistsError(
          f"Step {step} already exists in the persistent tier {self.directory}. Delete it "
          f"first with mgr.delete({step}) on every process to save it again.")
    if self._managed:
      raise ValueError(
          f"save({step}, force=True): step {step} is older than the newest RAM step "
          f"{newest_ram}, and in managed mode the RAM tier is the only tier this manager "
          "writes (its retention keeps the newest steps). Save a newer step, or delete the "
          "newer steps first with mgr.delete(step).")
    logging.warning("orbax-mtc: step %d is older than the newest RAM step %d: saved to the "
                    "persistent tier %s only.", step, newest_ram, self.directory)
    self._start_backup(step, args, metrics, custom_metadata)
    if not self._mtc_options.enable_async_checkpointing:
      self._poll_backup(block=True)
    return True

  def _save_parent_style(self, step: int, items: Any, save_kwargs: Any, metrics: Any,
                         force: bool | None, args: Any,
                         custom_metadata: dict[str, Any] | None) -> bool:
    """The parent's save on `directory`, unchanged; then the RAM tier, on its own schedule or
    (default) for each step the parent saved. Items the RAM tier cannot hold go to
    `directory` only."""
    with self._persistent_view():
      super().check_for_errors()  # Orbax's own (a failed RAM write travels in an agreement)
    self._replication_progress(block=False)
    with self._persistent_view():
      parent_saved = super().save(step, items=items, save_kwargs=save_kwargs, metrics=metrics,
                                  force=force, args=args, custom_metadata=custom_metadata)
    step = int(step)
    if args is not None:
      self._saved_with.update({name: type(item) for name, item in _named_items(args).items()})
    if self._mirror_parent_saves:
      self._drop_steps_parent_removed()
    local = self._mtc_options.local
    if local.read_only or step in self._agreed_ram:
      return parent_saved
    if self._mirror_parent_saves:
      local_due = parent_saved
    else:
      local_due = bool(force) or self.reached_preemption(step) or self._local_should_save(step)
    if not local_due:
      return parent_saved
    try:
      _check_ram_savable(args)
      trees, _, _ = self._split_save_args(args)
    except TypeError as e:
      self._warn_once("ram-args", "orbax-mtc: the RAM tier keeps PyTreeSave/StandardSave/JsonSave "
                      "items only; step %d and others like it go to %s alone (%s).", step,
                      self.directory, e)
      return parent_saved
    self._mesh_from(trees)
    try:
      self._save_local(step, args, parent_saved=True)
    except TypeError as e:  # a leaf the RAM tier cannot hold (the same on every process)
      self._warn_once("ram-leaf", "orbax-mtc: step %d goes to %s alone: %s", step,
                      self.directory, e)
      return parent_saved
    return True

  def _drop_steps_parent_removed(self) -> None:
    """Mirror mode: a step the parent's retention (or a delete) removed leaves RAM too."""
    kept = set(self._persistent_steps())
    replicating = self._replicator.pending_step if self._replicator is not None else None
    if replicating is not None and replicating not in kept:
      # Its copies must be out before its folder goes (the parent's list is the same on
      # every process: Orbax agrees it, so every process issues this collective).
      self._replication_progress(block=True)
    gone = [s for s in self._local_steps() if s not in kept]
    self._agreed_ram = tuple(s for s in self._agreed_ram if s in kept)
    if not gone:
      return
    self._wait_local()  # no write in flight while folders go (LKG link included)
    for s in gone:
      self._local.delete(s)
    self._refresh_lkg()

  def _warn_once(self, key: str, message: str, *args: Any) -> None:
    warned = self.__dict__.setdefault("_warned", set())
    if key not in warned:
      warned.add(key)
      logging.warning(message, *args)

  def _save_ondemand(self, step: int, args: Any, metrics: Any,
                     custom_metadata: dict[str, Any] | None) -> None:
    """The preemption save: RAM tier, then peers, then (within the grace budget) the
    persistent tier, each waited for; then, if configured, the process exits with status 0."""
    options = self._mtc_options
    agreed_at = time.time()
    signal_time = preemption.notice_time()
    if signal_time is not None and signal_time > agreed_at:
      signal_time = None  # another host's clock is ahead: the split cannot be trusted
    started = signal_time if signal_time is not None else agreed_at
    budget = float(options.ondemand_grace_seconds)
    seconds = {"agreement": agreed_at - started, "local": 0.0, "peers": 0.0, "persistent": 0.0}
    logging.warning("orbax-mtc: on-demand checkpoint of step %d (%.2fs after SIGTERM, budget "
                    "%.0fs)", step, seconds["agreement"], budget)

    t = time.time()
    if not options.local.read_only:
      # Whether the step is in RAM already is decided in the save's agreement (rule 8).
      self._save_local(step, args, ondemand=True)
      self._wait_local()
    seconds["local"] = time.time() - t

    t = time.time()
    if self._replicator is not None:
      self.replicate_pending()
    seconds["peers"] = time.time() - t

    t = time.time()
    self._drop_pending_backup("an on-demand checkpoint")
    self._poll_backup(block=True)  # a backup in flight may be of this very step
    backed_up = step in self._persistent_steps()
    wanted = not backed_up and not self._managed  # managed: the replicator backs it up
    in_budget = time.time() - started < budget  # after the wait above, which may be long
    # Orbax's save has barriers, so every process must take the same branch; their clocks,
    # and when each got here, differ.
    votes = self._agree(agreement.OnDemandRecord(fault=self._take_fault(), wants_backup=wanted,
                                                 in_budget=in_budget),
                        f"the on-demand save of step {step}")
    wanted = all(v.wants_backup for v in votes)
    in_budget = all(v.in_budget for v in votes)
    if wanted and in_budget:
      metadata = dict(custom_metadata or {})
      metadata[ONDEMAND_METADATA_KEY] = {"step": step, "signal_time": signal_time,
                                         "budget_seconds": budget, "seconds": dict(seconds)}
      self._start_backup(step, args, metrics, metadata)
      self._poll_backup(block=True)
      backed_up = step in self._persistent_steps()
    elif wanted:
      logging.warning("orbax-mtc: no on-demand persistent backup of step %d: the %.0fs grace "
                      "budget is spent (RAM tier and peers hold the step).", step, budget)
    seconds["persistent"] = time.time() - t
    seconds["total"] = time.time() - started

    record = OnDemandSave(step=step, signal_time=signal_time, budget_seconds=budget,
                          seconds=seconds, persistent=backed_up)
    self.last_ondemand = record
    if step in self._local_steps():
      self._write_ondemand_record(record)
    level = logging.WARNING if seconds["total"] > budget else logging.INFO
    logging.log(level, "orbax-mtc: on-demand checkpoint of step %d durable %.2fs after the "
                "SIGTERM (budget %.0fs): agreement %.2fs, local %.2fs, peers %.2fs, persistent "
                "%.2fs%s", step, seconds["total"], budget, seconds["agreement"],
                seconds["local"], seconds["peers"], seconds["persistent"],
                "" if backed_up else " (not backed up)")
    # A RAM write that failed somewhere is raised on every process alike, after the
    # persistent backup (taken from the arrays) had its chance.
    self._raise_agreed_faults(votes, f"the on-demand save of step {step}")
    if options.exit_after_ondemand_checkpoint:
      logging.warning("orbax-mtc: exiting after the on-demand checkpoint of step %d "
                      "(exit_after_ondemand_checkpoint).", step)
      self.close()
      raise SystemExit(0)

  def _write_ondemand_record(self, record: OnDemandSave) -> None:
    """Atomically adds ondemand.json to the committed step folder."""
    step_dir = self._local.directory / str(record.step)
    tmp = step_dir / f".{ONDEMAND_FILE}.tmp"
    try:
      with open(tmp, "w") as f:
        f.write(record.to_json())
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, step_dir / ONDEMAND_FILE)
      local_tier.fsync_dir(step_dir)
    except OSError as e:
      logging.warning("orbax-mtc: cannot record the on-demand breakdown in %s: %s", step_dir, e)

  def _save_local(self, step: int, args: Any, *, backup_wanted: bool = False,
                  metrics: Any = None, custom_metadata: dict[str, Any] | None = None,
                  parent_saved: bool = False, ondemand: bool = False) -> None:
    """Stages and writes `step` to RAM (and schedules its backup and peer copies).
    `parent_saved`: Orbax's own save has just written the step to `directory` (the parent-style
    form, which mirrors it into RAM). `ondemand`: the preemption save, which skips a step
    every node holds already."""
    trees, jsons, default_item = self._split_save_args(args)
    self._wait_local()  # one write in flight (as Orbax): steps commit in order
    # The previous step's copies must be out before retention may retire its folder.
    self._replication_progress(block=True)
    pending = self._backup_pending
    if pending is not None:
      # Read back right after its write, from RAM: done by now but for a very short interval.
      concurrent.futures.wait([pending.read])
    # The save's one agreement (every process saves the same steps, so it is issued in the
    # same order everywhere: main thread, rule 2). It carries every per-process fact the
    # branches below read, so that every process takes the same ones (rule 8), and any error
    # a process holds, so that every process raises it together (rule 9).
    own = self._local_steps()
    persistent = self._persistent_steps()
    record = agreement.SaveRecord(
        step=step, fault=self._take_fault(), inventory=self._inventory(own, persistent),
        has_step_in_ram=step in own, has_step_persistent=step in persistent,
        wants_backup=backup_wanted,
        backup_state=pending.state() if pending is not None else agreement.Status.NONE,
        orbax_busy=self._persistent_busy(), clock_ms=int(time.time() * 1000))
    records = self._agree(record, f"the save of step {step}")
    if len({r.step for r in records}) > 1:
      raise ValueError(
          "save() was called with different steps on different processes: " + ", ".join(
              f"process {p}: {r.step}" for p, r in enumerate(records)) +
          ". Every process must save the same step at the same point of the loop.")
    inventories = [r.inventory for r in records]
    newest = [max(inv.own_steps) if inv.own_steps else -1 for inv in inventories]
    floor = min(newest) if self._process_count > 1 and min(newest) >= 0 else None
    self._adopt(inventories)
    self._raise_agreed_faults(records, f"an earlier local write (before step {step})")
    in_ram = np.asarray([r.has_step_in_ram for r in records])
    in_persistent = np.asarray([r.has_step_persistent for r in records])
    backup_wanted = any(r.wants_backup for r in records)
    # Here, on the gathered figures alone, so that every process starts it or none does.
    backup_started = self._advance_backup(
        np.asarray([r.backup_state for r in records]), np.asarray([r.orbax_busy for r in records]))
    if ondemand and in_ram.all():
      return  # the preemption step is committed everywhere already
    if not parent_saved and not ondemand and in_ram.all() and backup_wanted and \
        not in_persistent.any():
      # Committed in RAM everywhere, not yet persistent (e.g. the final step, forced): back
      # up those RAM copies; `args` only describe them.
      self._schedule_backup(step, args, trees, jsons, metrics, custom_metadata, time.time())
      if not self._mtc_options.enable_async_checkpointing:
        self._flush_backup()
      return
    if ondemand and in_ram.any():
      # The on-demand step is in some folders only (an earlier save of it failed elsewhere):
      # those write it again with the others, from the same state.
      if step in own:
        self._local.delete(step)
    elif not parent_saved and not ondemand and (in_ram.any() or in_persistent.any()):
      # As Orbax: a step is never silently replaced (the tiers would then disagree on it).
      where = "" if in_ram.all() or not in_ram.any() else \
          f" of process(es) {np.flatnonzero(in_ram).tolist()} only"
      raise ocp.checkpoint_manager.StepAlreadyExistsError(
          f"Step {step} already exists (RAM tier {self._local.directory}{where} or persistent "
          f"tier {self.directory}). Delete it first with mgr.delete({step}) on every process "
          "to save it again.")
    if self._process_count > 1:
      # The newest step all nodes hold: kept beyond max_to_keep.
      self._local.keep_floor = floor
      # Steps kept only as the previous floor can go now, before this write reuses their file:
      # the RAM footprint stays at max_to_keep committed steps plus the one being written.
      self._local.apply_retention()
    self._adopt(inventories, saved=step, floor=floor)
    # Not `_backup_inflight`: each process clears that when it sees its own part end, so it
    # can differ between processes, and this answer decides whether the step is backed up.
    saving_anywhere = any(r.orbax_busy for r in records) or backup_started
    now = records[0].clock_ms / 1000
    if self._backup_policy is not None and not backup_wanted:
      backup_wanted = backup.interval_due(self._backup_policy, step, now,
                                          self._last_backup_attempt, saving_anywhere)
    started = time.perf_counter()
    staged = local_tier.stage(step, trees, jsons, default_item=default_item)
    self.last_save_blocking_seconds = time.perf_counter() - started
    if self._mtc_options.enable_async_checkpointing:
      self._pending = self._writer.submit(self._write_local, staged)
    else:
      self._pending = concurrent.futures.Future()
      try:
        self._write_local(staged)
        self._pending.set_result(None)
      except Exception as e:  # noqa: BLE001 - raised on every process by the agreement below
        self._pending.set_exception(e)
      self._wait_local()
    if backup_wanted:
      self._schedule_backup(step, args, trees, jsons, metrics, custom_metadata, now)
      if not self._mtc_options.enable_async_checkpointing:
        self._flush_backup()  # synchronous mode: both tiers hold the step when save returns
    if self._replicator is not None:
      self._replicator.schedule(step, self._shard_sets(trees))
      if not self._mtc_options.enable_async_checkpointing:
        self._replication_progress(block=True)
    if not self._mtc_options.enable_async_checkpointing:
      # Synchronous mode: the write is done, and its outcome is raised on every process alike.
      self._agree_steps(f"the save of step {step}")

  # ------------------------------------------------------------------ persistent backups

  def _newest_backup_time(self) -> tuple[int, float] | None:
    """(step, commit time) of the newest persistent step: the minutes count from there."""
    steps = self._persistent_steps()
    if not steps:
      return None
    try:
      with self._persistent_view():
        nsecs = super().metadata(steps[-1]).commit_timestamp_nsecs
    except Exception as e:  # noqa: BLE001 - an unreadable time only moves the first backup
      logging.warning("orbax-mtc: no commit time for persistent step %d (%s); the first "
                      "backup is taken at the first local save.", steps[-1], e)
      return None
    return (steps[-1], nsecs / 1e9) if nsecs else None

  def _schedule_backup(self, step: int, args: Any, trees: dict[str, Any],
                       jsons: dict[str, Any], metrics: Any,
                       custom_metadata: dict[str, Any] | None, now: float) -> None:
    """Marks `step` for backup: once its local write commits, the writer thread reads it back
    from the RAM disk (after the write, before any later write can reuse its files)."""
    self._drop_pending_backup(f"step {step}")
    templates, single = backup.templates(args)
    targets = backup.host_targets(trees)
    targets.update({name: None for name in jsons})
    pending = backup.PendingBackup(
        step=step, templates=templates, single=single, targets=targets,
        memory_kind=backup.host_memory_kind(trees), metrics=metrics,
        custom_metadata=custom_metadata)
    pending.read = self._writer.submit(self._read_for_backup, pending)
    self._backup_pending = pending
    self._last_backup_attempt = (step, now)

  def _read_for_backup(self, pending: backup.PendingBackup) -> dict[str, Any]:
    """Writer thread (file I/O only): the committed step, checksums verified, as host arrays."""
    step_dir = self._local.directory / str(pending.step)
    manifest = self._local.manifest(pending.step)
    crcs: dict[tuple[int, int], int] = {}
    data = local_tier.read_data(step_dir, manifest, crcs)
    return local_tier.arrays_from_buffer(data, manifest, pending.targets, str(step_dir),
                                         crcs=crcs, memory_kind=pending.memory_kind)

  def _drop_pending_backup(self, reason: str) -> None:
    pending, self._backup_pending = self._backup_pending, None
    if pending is not None:
      logging.info("orbax-mtc: backup of step %d superseded by %s.", pending.step, reason)

  def _advance_backup(self, states: np.ndarray, busy: np.ndarray) -> bool:
    """Starts the pending backup once every process has read its copy and no earlier backup
    is being written on any (`states` and `busy`, per process, come from an all-gather: the
    same decision everywhere). Returns whether it started it."""
    pending = self._backup_pending
    if pending is None:
      return False
    if (states == backup.FAILED).any():
      self._backup_pending = None
      bad = [p for p, state in enumerate(states) if state == backup.FAILED]
      error = pending.read.exception() if pending.read is not None and pending.read.done() \
          else None
      logging.warning("orbax-mtc: no backup of step %d: its RAM copy could not be read on "
                      "process(es) %s%s; the next scheduled backup takes a newer step.",
                      pending.step, bad, f" ({error})" if error is not None else "")
      return False
    if busy.any():
      self._note_backup_waiting(pending.step, np.flatnonzero(busy).tolist())
      return False
    if not (states == backup.READY).all():
      return False
    self._backup_pending = None
    values = pending.read.result()
    args = backup.backup_args(pending.templates, pending.single, values)
    self._start_backup(pending.step, args, pending.metrics, pending.custom_metadata)
    return True

  def _note_backup_waiting(self, step: int, busy: list[int]) -> None:
    """Warns once when due backups have waited longer than Orbax's timeout for an earlier one
    that still runs: a storage write hangs (Orbax's timeout does not cover its metadata
    write), and no backup starts until it ends."""
    now = time.monotonic()
    if self._backup_waiting_since is None:
      self._backup_waiting_since = now
      return
    timeout = (self._mtc_options.async_options or ocp.AsyncOptions()).timeout_secs
    waited = now - self._backup_waiting_since
    if waited > timeout and not self._warned_backup_waiting:
      self._warned_backup_waiting = True
      logging.warning(
          "orbax-mtc: no backup has started for %.0f s, longer than Orbax's timeout (%d s): an "
          "earlier backup to %s still runs on process(es) %s, so a storage write may hang. "
          "Training goes on and the RAM tier and peers keep the newest steps; the backup of "
          "step %d starts once it ends.", waited, timeout, self.directory, busy, step)

  def _start_backup(self, step: int, args: Any, metrics: Any,
                    custom_metadata: dict[str, Any] | None) -> None:
    """The parent's save of `step` (Orbax writes in the background); every process calls it."""
    self._backup_waiting_since, self._warned_backup_waiting = None, False
    self._poll_backup()
    self._drain_parent_errors()
    self.last_backup = backup.BackupInfo(step=step, state="uploading", started_at=time.time())
    self._backup_inflight = step
    try:
      with self._persistent_view():
        super().save(step, args=args, metrics=metrics, force=True,
                     custom_metadata=custom_metadata)
    except Exception as e:  # noqa: BLE001 - a failed backup must not stop training
      self._backup_failed(step, e)

  def _drain_parent_errors(self) -> None:
    """Consumes what Orbax still holds of earlier backups on this process, waiting for any of
    it still running (backups by schedule start only when none runs anywhere): errors its
    next `save()` would otherwise raise here alone, between barriers every process must
    reach, which would leave the others waiting there for good."""
    errors = []
    with self._persistent_view():
      try:
        super().wait_until_finished()
      except Exception as e:  # noqa: BLE001 - logged below
        errors.append(e)
    errors += backup.collect_orbax_errors(self._checkpointer)
    for error in errors:
      logging.warning("orbax-mtc: an earlier backup to %s ended with %s: %s", self.directory,
                      type(error).__name__, error)

  def _record_backup(self, step: int, state: str, error: str | None = None) -> None:
    """How the attempt at `step` ended, in `last_backup` and `backup_history`."""
    last = self.last_backup
    started = last.started_at if last is not None and last.step == step else time.time()
    self.last_backup = backup.BackupInfo(step=step, state=state, started_at=started, error=error)
    self.backup_history.append(self.last_backup)

  def _backup_failed(self, step: int, error: BaseException) -> None:
    self._backup_inflight = None
    self._backup_error = backup.BackupError(step, error)
    self._record_backup(step, "failed", f"{type(error).__name__}: {error}")
    logging.error("orbax-mtc: persistent backup of step %d to %s failed: %s: %s. Training "
                  "goes on; the step stays in the RAM tier and the next scheduled backup "
                  "tries again.", step, self.directory, type(error).__name__, error)

  def _poll_backup(self, *, block: bool = False) -> None:
    """Learns how the backup in flight ended (no collective): a failure is logged once and
    kept for `wait_until_finished`/`close` to report; training goes on."""
    step = self._backup_inflight
    if step is None:
      return
    if not block and self._persistent_finalizing():
      return
    with self._persistent_view():
      try:
        super().wait_until_finished()  # raises the background failure, once
      except Exception as e:  # noqa: BLE001 - reported through _backup_error
        self._backup_failed(step, e)
        return
    self._backup_inflight = None
    if step in self._persistent_steps():
      self._backup_error = None  # the newest backup is good: older failures are moot
      self._record_backup(step, "done")
    else:
      self._backup_failed(step, RuntimeError("the step was not finalized"))

  def _flush_backup(self) -> None:
    """Starts the pending backup now and waits for it (every process calls this)."""
    pending = self._backup_pending
    if pending is not None:
      concurrent.futures.wait([pending.read])
      self._poll_backup(block=True)
      records = self._agree(agreement.ReadBackRecord(state=pending.state()),
                            f"the backup of step {pending.step}")
      states = np.asarray([r.state for r in records])
      self._advance_backup(states, np.zeros(states.shape, dtype=bool))
    self._poll_backup(block=True)

  def _report_backup_error(self) -> None:
    error, self._backup_error = self._backup_error, None
    if error is not None:
      raise error

  # ------------------------------------------------------------------ replication

  def _shard_sets(self, trees: dict[str, Any]) -> list:
    """Which shards every process holds under the shardings of `trees` (cached)."""
    key = tuple((name, tuple((leaf.sharding, tuple(leaf.shape))
                             for leaf in jax.tree_util.tree_leaves(tree)
                             if getattr(leaf, "sharding", None) is not None),
                 jax.tree_util.tree_structure(tree))
                for name, tree in trees.items())
    if self._shard_sets_cache is None or self._shard_sets_cache[0] != key:
      self._shard_sets_cache = (key, replication.shard_sets(trees, self._process_count))
    return self._shard_sets_cache[1]

  def _replication_status(self, step: int) -> int:
    if self._pending is not None and not self._pending.done():
      return replication.WRITING
    return replication.COMMITTED if step in self._local_steps() else replication.FAILED

  def _replication_progress(self, *, block: bool) -> None:
    """Moves pending peer copies forward (collectives: every process calls this in step)."""
    replicator = self._replicator
    if replicator is None or replicator.pending_step is None:
      return
    if block:
      self._wait_local()
    replicator.progress(self._replication_status(replicator.pending_step), block=block)

  @_persistent_view_when_nested
  def replicate_pending(self) -> None:
    """Sends the newest local step to its peers now, blocking until the bytes are out.

    Every process must call it at the same point (it issues collectives). `save()` already
    does this a few chunks at a time; call it before a planned stop to protect the last step.
    """
    self._replication_progress(block=True)
    if self._replicator is not None:
      self._writer.submit(lambda: None).result()  # received copies are committed

  def _write_local(self, staged: local_tier.StagedStep) -> None:
    try:
      self._local.write(staged, self._process_index, self._process_count)
    except OSError as e:
      raise OSError(
          e.errno, f"orbax-mtc: local save of step {staged.step} to {self._local.directory} "
          f"failed: {e.strerror}. Committed steps are untouched. If the RAM disk is full, "
          "lower LocalCheckpointOptions.max_to_keep or enlarge the RAM disk (GKE sizing: "
          "2.2x the per-node checkpoint on TPU).") from e

  def _wait_local(self) -> None:
    """Waits for the local write in flight. Its error is kept for the next agreement, which
    raises it on every process alike (raised here, on one process, it would leave the others
    waiting in their next collective)."""
    pending, self._pending = self._pending, None
    if pending is None:
      return
    try:
      pending.result()
    except Exception as e:  # noqa: BLE001 - reported through the next agreement
      if self._local_error is None:
        self._local_error = e
      else:
        logging.error("orbax-mtc: a further local write failed before the first error was "
                      "reported: %s: %s", type(e).__name__, e)

  # ------------------------------------------------------------------ restore

  def _restore_targets(self, args: Any) -> tuple[dict[str, Any], bool | None]:
    """Item name -> restore target (pytree or None for JSON); single-item flag if known."""
    if args is None:
      if self._abstract_state is None:
        raise ValueError("restore() needs args or an abstract_state given to the manager.")
      return {"state": self._abstract_state}, None
    if isinstance(args, _PYTREE_RESTORE):
      return {_DEFAULT_ITEM: args.item if args.item is not None else self._abstract_state}, True
    if isinstance(args, ocp.args.Composite):
      targets = {}
      for name, item in args.items():
        if isinstance(item, _PYTREE_RESTORE):
          targets[name] = item.item if item.item is not None else self._abstract_state
        elif isinstance(item, ocp.args.JsonRestore):
          targets[name] = None
        else:
          raise TypeError(f"Item {name!r}: {type(item).__name__} is not supported by the "
                          "RAM tier restore (PyTreeRestore/StandardRestore/JsonRestore).")
        if targets[name] is None and not isinstance(item, ocp.args.JsonRestore):
          raise ValueError(f"Item {name!r}: give PyTreeRestore(item=abstract_tree) or an "
                           "abstract_state to the manager.")
      return targets, False
    raise TypeError(f"restore() args must be Composite, PyTreeRestore or StandardRestore; got "
                    f"{type(args).__name__}.")

  def _try_local(self, step: int, targets: dict[str, Any], single: bool | None,
                 source: tuple[local_tier.StepManifest, np.ndarray] | None = None,
                 own_crcs: dict[tuple[int, int], int] | None = None
                 ) -> tuple[agreement.Status, Any, str]:
    """Builds the targets from this node's folder of `step`, or from `source`: a step that
    came from a twin or a peer, or (with `own_crcs`, its checksums) this node's own step
    already read. Returns (status, (items, default_item), message); never raises, so that
    every process reaches the agreement on the outcome."""
    try:
      crcs: dict[tuple[int, int], int] = dict(own_crcs or {})
      if source is None:
        manifest = self._local.manifest(step)
        data = local_tier.read_data(self._local.directory / str(step), manifest, crcs)
        where = str(self._local.directory / str(step))
      else:
        manifest, data = source
        where = str(self._local.directory / str(step)) if own_crcs is not None else \
            f"step {step} received from another node"
      if single is None and manifest.default_item:  # args omitted: follow how it was saved
        targets = {_DEFAULT_ITEM: targets["state"]}
      restored = local_tier.arrays_from_buffer(data, manifest, targets, where, crcs=crcs)
      return agreement.Status.OK, (restored, manifest.default_item), ""
    except local_tier.AbstractStateMismatchError as e:
      return agreement.Status.MISMATCH, None, str(e)
    except Exception as e:  # noqa: BLE001 - any failure makes this source unusable
      if not isinstance(e, (local_tier.LocalTierError, OSError)):
        logging.exception("orbax-mtc: unexpected error reading step %d", step)
      return agreement.Status.UNUSABLE, None, f"{type(e).__name__}: {e}"

  def _assemble(self, assembly: restore_plan.Assembly, targets: dict[str, Any],
                single: bool | None) -> tuple[bool, Any, set[tuple[int, int, int]]]:
    """Executes one RAM assembly: transfers to nodes that lost the step, then every node
    builds its arrays. Returns (ok, value, sources to exclude when not ok); same result on
    every process."""
    me, step = self._process_index, assembly.step
    transfers = assembly.transfers
    received: tuple[local_tier.StepManifest, np.ndarray] | None = None
    # A twin that serves its own folder and restores from it reads (and checks) it once.
    own_read: replication.OwnStep | None = None
    if transfers:
      outgoing: dict[int, peer_store.OutgoingStream] = {}
      sizes = np.zeros((len(transfers),), dtype=np.int64)
      problems: list[str] = []
      for j, (holder, dest, kind) in enumerate(transfers):
        if holder != me:
          continue
        try:
          if kind == "twin" and own_read is None:
            own_read = replication.read_own(self._local, step)
          outgoing[dest] = replication.outgoing_step(
              kind, dest, step, self._local, self._store, own_read)
          sizes[j] = outgoing[dest].nbytes
        except Exception as e:  # noqa: BLE001 - every failure is agreed below, never raised
          problems.append(f"to process {dest} from its {kind}: {type(e).__name__}: {e}")
          sizes[j] = -1
      served = agreement.ServeRecord(
          status=agreement.Status.FAILED if problems else agreement.Status.OK,
          message="; ".join(problems))
      gathered = agreement.gather_with_sizes(
          served, sizes, lambda row: self._allgather(row, f"serving step {step}"))
      for p, (record, _) in enumerate(gathered):
        if record.status != agreement.Status.OK:
          logging.warning("orbax-mtc: process %d cannot serve step %d: %s", p, step,
                          record.message)
      sizes = np.asarray([gathered[h][1][j] for j, (h, _, _) in enumerate(transfers)])
      failed = {(h, d, step) for (h, d, _), n in zip(transfers, sizes, strict=True) if n < 0}
      if failed:
        return False, None, failed
      buffers, sink_for = replication.receive_buffers()
      transport.Transfer(
          [transport.Stream(h, d, int(n)) for (h, d, _), n in zip(transfers, sizes, strict=True)],
          me=me, reader_for=lambda s: outgoing[s.destination].read, sink_for=sink_for,
          chunk_limit=self._mtc_options.replication.chunk_bytes,
          window=self._mtc_options.replication.chunks_in_flight).run()
      mine = assembly.sources[me]
      if mine.kind != restore_plan.OWN:
        try:
          manifest, data = peer_store.received_step(buffers[mine.holder])
          # A step stream's header names no step of its own: check the manifest's.
          local_tier.validate_for(manifest, where=f"step {step} from process {mine.holder}",
                                  step=step)
          received = (dataclasses.replace(manifest, process_index=me), data)
        except Exception as e:  # noqa: BLE001 - an unusable copy is agreed below
          logging.warning("orbax-mtc: step %d from process %d is unusable: %s", step,
                          mine.holder, e)
          received = None
    mine = assembly.sources[me]
    if mine.kind != restore_plan.OWN and received is None:
      status, value, message = agreement.Status.UNUSABLE, None, "nothing usable received"
    elif mine.kind == restore_plan.OWN and own_read is not None:
      status, value, message = self._try_local(step, targets, single, own_read[:2],
                                               own_read[2])
    else:
      status, value, message = self._try_local(step, targets, single, received)
    built = self._agree(agreement.BuildRecord(status=status, message=message),
                        f"building step {step}")
    if all(b.status == agreement.Status.OK for b in built):
      if received is not None:
        self._recovered = received
      return True, value, set()
    mismatched = [p for p, b in enumerate(built) if b.status == agreement.Status.MISMATCH]
    if mismatched:
      # The caller's error, not a bad copy: the same error everywhere, and nothing deleted.
      culprit = mismatched[0]
      raise local_tier.AbstractStateMismatchError(
          f"process {culprit}: {built[culprit].message} (step {step} is kept in every tier).")
    bad = [p for p, b in enumerate(built) if b.status != agreement.Status.OK]
    logging.warning("orbax-mtc: step %d unusable on process(es) %s (%s); trying another source, "
                    "an older step or the persistent tier.", step, bad,
                    "; ".join(f"process {p}: {built[p].message}" for p in bad))
    return False, None, {(assembly.sources[p].holder, p, step) for p in bad}

  def _after_recovery(self, assembly: restore_plan.Assembly, sets: list | None) -> None:
    """A node that got its step from elsewhere writes it back into its own folder, and the
    copies that involve recovered nodes are sent again (at the next save or
    `replicate_pending`)."""
    received, self._recovered = self._recovered, None
    step = assembly.step
    if received is not None:
      manifest, data = received
      if step in self._local_steps():  # its own copy was unusable (corrupt): replace it
        self._local.delete(step)
      staged = local_tier.StagedStep.from_buffer(step, data, manifest.data_size, manifest.items,
                                                 manifest.default_item)
      self._pending = self._writer.submit(self._write_local, staged)
    if self._replicator is not None and sets is not None:
      recovered = set(assembly.recovered)
      edges = [e for e in self._topology.edges if e[0] in recovered or e[1] in recovered]
      self._replicator.schedule(step, sets, edges)

  @_persistent_view_when_nested
  def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
              directory: epath.PathLike | None = None, args: Any = None) -> Any:
    """Restores the newest step the whole cluster can assemble (see module docstring)."""
    if self._parent_style:
      return self._restore_parent_style(step, items, restore_kwargs, directory, args)
    if items is not None and args is None:
      args = items if isinstance(items, ocp.args.CheckpointArgs) else \
          ocp.args.PyTreeRestore(items)
    if directory is not None:  # an explicit folder is a plain Orbax restore
      with self._persistent_view():
        return super().restore(step, directory=directory, args=args)
    started = time.perf_counter()
    self._wait_local()
    self._drop_pending_backup("a restore")
    targets, single = self._restore_targets(args)
    if self._managed and step is None:
      entry_step = self._replicator_step()
      if entry_step:
        found, value, _, _ = self._restore_from_ram(entry_step, targets, single, started)
        if found:
          self.last_restore = dataclasses.replace(self.last_restore, tier="replicator")
          return value
      elif entry_step == 0:  # the replicator has nothing: the persistent tier, else scratch
        persistent_steps = self._agreed_persistent
        if persistent_steps:
          restored = self._restore_persistent(persistent_steps[-1], targets, single)
          self._finish_restore(persistent_steps[-1], "persistent", started, drop_newer=True)
          return restored
        self._start_from_scratch(started)
        return None
    found, value, plan, tried = self._restore_from_ram(step, targets, single, started)
    if found:
      return value
    if plan.persistent_step is not None:
      restored = self._restore_persistent(plan.persistent_step, targets, single)
      self._finish_restore(plan.persistent_step, "persistent", started, drop_newer=step is None)
      return restored
    if step is not None:
      if tried:
        raise local_tier.LocalTierError(
            f"Step {step} is in the RAM tier of every process but could not be used (corrupt "
            "or incomplete; see the warnings above) and the persistent tier does not have it.")
      raise FileNotFoundError(
          f"Step {step} is in neither tier: local steps (this process) {self._local_steps()}, "
          f"persistent steps {self._persistent_steps()}.")
    self._start_from_scratch(started)
    return None

  def _restore_parent_style(self, step: int | None, items: Any, restore_kwargs: Any,
                            directory: epath.PathLike | None, args: Any) -> Any:
    """RAM first when the args say what to build and every process holds the step; otherwise
    exactly the parent's restore of `directory`."""
    # Only args that say exactly what to build (arrays with shardings, no per-leaf restore
    # options) can come from RAM; the parent serves everything else as it always did.
    single_mode = not isinstance(args, ocp.args.Composite)
    ram_args = _ram_restore_args(args, self._saved_with) if directory is None else None
    if ram_args is not None and self._default_item.get() in (None, single_mode):
      targets, single = self._restore_targets(ram_args)
      started = time.perf_counter()
      self._wait_local()
      self._mesh_from(targets)
      try:
        found, value, _, _ = self._restore_from_ram(step, targets, single, started)
      except local_tier.AbstractStateMismatchError as e:
        # The parent decides what a different target means (partial restore, casting...).
        logging.info("orbax-mtc: RAM copy does not match the restore target (%s); restoring "
                     "from %s", e, self.directory)
        found, value = False, None
      if found:
        self._default_item.set_if_none(single_mode)
        return value
    with self._persistent_view():
      return super().restore(step, items=items, restore_kwargs=restore_kwargs,
                             directory=directory, args=args)

  def _restore_from_ram(self, step: int | None, targets: dict[str, Any], single: bool | None,
                        started: float) -> tuple[bool, Any, restore_plan.RestorePlan, bool]:
    """(found, restored value, last plan, whether a RAM step was tried and failed).

    Collective: every process calls it with the same step and targets.
    """
    # Copies still in flight would race with the folders this restore reads and rewrites.
    self._replication_progress(block=True)
    records = self._agree(agreement.RestoreRecord(
        requested_step=-1 if step is None else int(step), fault=self._take_fault(),
        inventory=self._inventory()), "restore")
    asked = [r.requested_step for r in records]
    if len(set(asked)) > 1:
      raise ValueError(
          "restore() was called with different steps on different processes: " + ", ".join(
              f"process {p}: {'None' if s < 0 else s}" for p, s in enumerate(asked)) +
          ". Every process must restore the same step; use step = mgr.latest_step(), which "
          "is the same on every process.")
    for p, fault in agreement.faults(records).items():
      # An earlier write that failed left nothing committed: the plan below does not use it.
      logging.warning("orbax-mtc: process %d: an earlier local write failed (%s: %s); "
                      "restoring from what the cluster holds.", p, fault.kind, fault.message)
    self._fault_cause = None
    inventories = self._adopt([r.inventory for r in records])
    persistent_steps = self._agreed_persistent
    groups = sets = None
    # Targets that take their shape from the checkpoint (SavedLeaf) cannot say which shards
    # twins share before a step is read: then every node restores from its own folder.
    if self._topology is not None and not any(
        isinstance(leaf, local_tier.SavedLeaf)
        for tree in targets.values() for leaf in jax.tree_util.tree_leaves(tree)):
      sets = self._shard_sets(targets)
      groups = replication.shard_groups(sets)
    excluded: set[tuple[int, int, int]] = set()
    failed_steps: set[int] = set()
    while True:
      plan = restore_plan.plan_restore(inventories, persistent_steps, step,
                                       shard_groups=groups, excluded=excluded)
      candidates = [a for a in plan.candidates if a.step not in failed_steps]
      if not candidates:
        tried = bool(plan.local_candidates or failed_steps or excluded)
        return False, None, plan, tried
      assembly = candidates[0]
      ok, value, exclusions = self._assemble(assembly, targets, single)
      if ok:
        restored, default_item = value
        # Per process: "peer" when this node's bytes came from a twin or a peer's copy.
        mine = assembly.sources[self._process_index].kind
        tier = "local" if mine == restore_plan.OWN else "peer"
        self._finish_restore(assembly.step, tier, started, drop_newer=step is None)
        if assembly.transfers:
          self._after_recovery(assembly, sets)
        if single or (single is None and default_item):
          return True, restored[_DEFAULT_ITEM], plan, False
        return True, ocp.args.Composite(**restored), plan, False
      new = set(exclusions) - excluded
      if not new:
        failed_steps.add(assembly.step)
      excluded |= new

  def _start_from_scratch(self, started: float) -> None:
    logging.info("orbax-mtc: no checkpoint in RAM (%s) or in %s: starting from scratch.",
                 self._local.directory, self.directory)
    # Local steps no other process shares belong to an earlier run: drop them, or this node
    # would skip saving those step numbers and a later restore could mix the two runs.
    leftovers = self._local_steps()
    for s in leftovers:
      self._local.delete(s)
    if leftovers:
      self._refresh_lkg()
    self._writer.submit(lambda: None).result()  # copies in flight land before the drop
    self._store.drop_newer(-1)
    self._agreed_ram = ()
    self.last_restore = RestoreInfo(step=None, tier="none",
                                    seconds=time.perf_counter() - started)

  def _restore_persistent(self, step: int, targets: dict[str, Any], single: bool | None) -> Any:
    step_dir = epath.Path(self._get_read_step_directory(step, self.directory))
    saved_items = sorted(p.name for p in step_dir.iterdir() if p.is_dir()) \
        if step_dir.is_dir() else []
    saved_single = saved_items == [_DEFAULT_ITEM]
    if single is None:
      single = saved_single
      if single:
        targets = {_DEFAULT_ITEM: targets["state"]}

    for name, target in targets.items():
      if target is not None:
        self._check_persistent_item(step_dir / name, name, target)

    def restore_arg(target):
      if target is None:
        return ocp.args.JsonRestore()
      return ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))

    with self._persistent_view():
      if single:
        return super().restore(step, args=restore_arg(targets[_DEFAULT_ITEM]))
      return super().restore(step, args=ocp.args.Composite(
          **{name: restore_arg(t) for name, t in targets.items()}))

  @staticmethod
  def _check_persistent_item(item_dir: epath.Path, name: str, target: Any) -> None:
    """Same clear error as the RAM tier for a target that does not match the saved tree.

    Orbax alone would raise an error that does not name the leaf, or silently cast dtypes.
    """
    with ocp.PyTreeCheckpointer() as checkpointer:
      saved = checkpointer.metadata(item_dir)
    saved_tree = getattr(getattr(saved, "item_metadata", None), "tree", saved)
    saved_leaves = {_plain_path(p): leaf
                    for p, leaf in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
      path = _plain_path(key_path)
      meta = saved_leaves.get(path)
      if meta is None:
        raise local_tier.AbstractStateMismatchError(
            f"Leaf {name}{path} of the restore target is not in the persistent checkpoint "
            f"{item_dir} (it holds {sorted(saved_leaves)[:8]}).")
      if not hasattr(leaf, "shape") or not hasattr(meta, "shape"):
        continue  # Python scalars and other non-array leaves carry no shape to compare
      # Orbax stores (and describes) a PRNG key leaf as its key data.
      want_shape, want_dtype = local_tier.stored_spec(leaf.shape, leaf.dtype)
      have_shape, have_dtype = tuple(meta.shape), np.dtype(meta.dtype)
      if want_shape != have_shape or want_dtype != have_dtype:
        asked = f"shape {want_shape} dtype {want_dtype.name}"
        if local_tier.is_key_dtype(leaf.dtype):
          asked = f"shape {tuple(leaf.shape)} dtype {leaf.dtype.name} (stored as {asked})"
        raise local_tier.AbstractStateMismatchError(
            f"Leaf {name}{path}: the persistent checkpoint holds shape {have_shape} dtype "
            f"{have_dtype.name}, but the target asks for {asked}. Pass an abstract state that "
            "matches the saved one.")

  def _finish_restore(self, step: int, tier: str, started: float, *, drop_newer: bool) -> None:
    # After restore(None), local steps newer than the agreed one exist on some nodes only and
    # belong to a timeline the job abandons: drop them so that they can neither be restored
    # later nor block saving those step numbers again. An explicit restore(step) keeps them.
    if drop_newer:
      stale = [s for s in self._local_steps() if s > step]
      for s in stale:
        self._local.delete(s)
      if stale:
        self._refresh_lkg()
      # Peer copies received before this restore are committed on the writer thread: let
      # them land first, or a newer one could be committed after the drop below.
      self._writer.submit(lambda: None).result()
      self._store.drop_newer(step)
      self._agreed_ram = tuple(s for s in self._agreed_ram if s <= step)
    self.last_restore = RestoreInfo(step=step, tier=tier, seconds=time.perf_counter() - started)
    logging.info("orbax-mtc: restored step %d from the %s tier in %.2fs", step, tier,
                 self.last_restore.seconds)

  # ------------------------------------------------------------------ steps and metadata

  @_persistent_view_when_nested
  def all_steps(self, read: bool = False) -> list[int]:
    if self._parent_style and self._mirror_parent_saves:
      # The RAM tier holds copies of the parent's steps: the parent's list is the list.
      with self._persistent_view():
        return list(super().all_steps(read))
    # The agreed lists (rule 8): the same on every process, and kept current by the
    # agreements that start-up, each local save, restore, delete, reload and
    # wait_until_finished make anyway; this call issues no collective.
    return sorted(set(self._agreed_ram) | set(self._agreed_persistent))

  @_persistent_view_when_nested
  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @_persistent_view_when_nested
  def reload(self):
    """Re-reads both tiers and agrees the step lists again (every process calls it)."""
    with self._persistent_view():
      super().reload()
    self._agree_steps("reload")

  @_persistent_view_when_nested
  def delete(self, step: int):
    """Deletes `step` from this node's RAM tier and from the persistent tier."""
    # Neither the local writer nor Orbax's finalize thread may still be writing the step.
    self._finish_all(f"delete({step})")
    if step in self._local_steps():
      self._local.delete(step)
      self._refresh_lkg()
    self._store.delete_step(step)
    if step in self._agreed_persistent or step in self._persistent_steps():
      with self._persistent_view():
        super().delete(step)
    self._agreed_ram = tuple(s for s in self._agreed_ram if s != step)
    self._agreed_persistent = tuple(s for s in self._agreed_persistent if s != step)

  @_persistent_view_when_nested
  def item_metadata(self, step: int) -> Any:
    if step in self._persistent_steps():
      with self._persistent_view():
        return super().item_metadata(step)
    manifest = self._local.manifest(step)
    return local_tier.item_metadata(manifest)

  @_persistent_view_when_nested
  def metadata(self, step: int | None = None) -> Any:
    with self._persistent_view():
      if step is None or step in self._persistent_steps():
        return super().metadata(step)
    manifest = self._local.manifest(step)
    custom: dict[str, Any] = {}
    record = self._local.directory / str(step) / ONDEMAND_FILE
    if record.is_file():
      with contextlib.suppress(OSError, ValueError):
        custom[ONDEMAND_METADATA_KEY] = json.loads(record.read_text())
    return ocp.metadata.StepMetadata(
        item_metadata=local_tier.item_metadata(manifest),
        commit_timestamp_nsecs=int(manifest.created_at * 1e9), custom_metadata=custom)

  @_persistent_view_when_nested
  def is_saving_in_progress(self) -> bool:
    if self._pending is not None and not self._pending.done():
      return True
    if self._backup_pending is not None:
      return True
    return self._persistent_busy()

  def _persistent_busy(self) -> bool:
    """Whether Orbax still works on a backup on this process (finalize thread, commit thread,
    metadata file write): a backup started now would wait for it on the main thread."""
    return self._persistent_finalizing() or backup.orbax_writes_running(self._checkpointer)

  def _persistent_finalizing(self) -> bool:
    """Whether Orbax's finalize thread of the newest backup still runs on this process.

    Asked of the thread, not of the parent's `is_saving_in_progress()`: that flag is cleared
    through a barrier (with Orbax's timeout) on the finalize thread, and when a process's
    finalize comes late (a hung write) the barrier times out and the flag stays True for
    good, which would stop every later backup. Another Orbax version without the thread
    falls back to the flag.
    """
    finalize = self.__dict__.get("_finalize_thread")
    if finalize is None or not hasattr(finalize, "map"):
      with self._persistent_view():
        return super().is_saving_in_progress()
    return bool(finalize.map(lambda thread: thread is not None and thread.is_alive()))

  # ------------------------------------------------------------------ lifecycle

  def _finish_all(self, what: str, *, report_backup: bool = False) -> None:
    """RAM write, peer copies, the pending backup: all done, and the step lists and errors
    agreed (every process calls this; errors are raised on every process alike)."""
    self._wait_local()
    self.replicate_pending()
    if self._parent_style:
      self._agree_steps(what)
      with self._persistent_view():
        super().wait_until_finished()
      return
    self._flush_backup()
    self._agree_steps(what, report_backup=report_backup)

  @_persistent_view_when_nested
  def wait_until_finished(self):
    """Waits for the RAM write, the peer copies and the backup in flight (a backup is bounded
    by Orbax's `AsyncOptions.timeout_secs`, but for its step metadata write, which only the
    storage client's own timeouts bound). Every process calls it at the same point of the
    loop (it is an agreement, as in Orbax's multi-host waits); on every process alike it
    raises `CheckpointError` for a failed RAM write on any of them, else `BackupError` if the
    newest backup failed (once per failure; the RAM tier still holds the step)."""
    self._finish_all("wait_until_finished", report_backup=True)

  @_persistent_view_when_nested
  def check_for_errors(self):
    """Raises `BackupError` for a failed newest backup (once), on this process. A failed RAM
    write is raised by the next save or `wait_until_finished`, on every process alike."""
    if not self._parent_style and threading.current_thread() is not self._owner_thread:
      # Orbax's finalize thread asks too: it means the persistent tier's own errors.
      with self._persistent_view():
        return super().check_for_errors()
    if self._parent_style:
      with self._persistent_view():
        super().check_for_errors()
      return
    self._poll_backup()
    self._report_backup_error()

  @_persistent_view_when_nested
  def close(self):
    if self._closed:
      return
    self._closed = True
    try:
      self.wait_until_finished()
    finally:
      self._writer.shutdown(wait=True)
      self._local.close()
      if self._directory_lock is not None:
        self._directory_lock.release()
      if self._own_sigterm_handler:
        preemption.detach()
      with self._persistent_view():
        super().close()
