"""Pax's training checkpointer on orbax-mtc, and the creator `install()` puts in Pax's place.

`PaxTrainingCheckpointer` has the calls Pax's executor makes (paxml/executors.py, the pjit
checkpointer of paxml/checkpoint_creators.py): `save_if_needed` at the top of every step,
`reached_preemption` right after it when `--exit_after_ondemand_checkpoint` is set,
`save_final` and `close` at the end, `step_to_restore` and `get_model_states` at set-up.

A SIGTERM to any host (Cloud TPU maintenance with `--autocheckpoint-enabled`) turns into an
on-demand save of one step every process agrees on, inside `save_if_needed`: RAM tier, peers
and (within the grace budget) the persistent tier, all durable when it returns. Pax's executor
then sees `reached_preemption(step)` True, calls `close()` and exits with status 1
(`PAX_ONDEMAND_EXIT_STATUS`), as it does with Pax's own checkpointer. orbax-mtc's built-in
`exit_after_ondemand_checkpoint` is not used: it would end the process with status 0 from
inside `save`, before Pax's executor reaches its own exit. A failed persistent backup is logged
and training goes on (the step is in RAM); `close()` reports it.

`create_checkpointer` has the signature of Pax's `checkpoint_creators._create_checkpointer`
and reads Pax's task config (`task_p.train.save_interval_steps`, `save_max_to_keep`,
`save_keep_interval_duration`, ...) for the persistent tier; the RAM tier and peers come from
`MtcConfig` (the `--mtc_*` flags).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

import orbax_mtc
from pax_patch import checkpoint_manager
from pax_patch.checkpoint_manager import PaxCheckpointManager

# paxml/executors.py ends the process with `exit(1)` after the on-demand checkpoint.
PAX_ONDEMAND_EXIT_STATUS = 1
# paxml/checkpoint_creators.py: the default bound on one asynchronous write.
PAX_ASYNC_TIMEOUT_SECS = 6 * 60 * 60


@dataclasses.dataclass(frozen=True)
class MtcConfig:
  """The orbax-mtc side of a Pax run (the `--mtc_*` flags of `python -m pax_patch.main`).

  Attributes:
    local_directory: This host's RAM-disk folder, an absolute path; None reads
      ORBAX_MTC_LOCAL_DIR (set by `orbax-mtc launch`).
    local_save_interval_steps: Save to RAM every N steps.
    peers_per_node: Nodes holding a copy of each node's RAM step (0: none).
    replica_axis: The data-parallel mesh axis (None: "data").
    local_max_to_keep: RAM steps kept per node.
    ondemand_grace_seconds: SIGTERM-to-durable budget for the on-demand persistent backup.

  Raises:
    ValueError: If an interval or count is not an int of its minimum or more,
      `local_directory` is not absolute, or `replica_axis` is empty.
  """

  local_directory: str | None = None
  local_save_interval_steps: int = 100
  peers_per_node: int = 1
  replica_axis: str | None = None
  local_max_to_keep: int = 1
  ondemand_grace_seconds: float = 270.0

  def __post_init__(self):
    for name, minimum in (("local_save_interval_steps", 1), ("peers_per_node", 0),
                          ("local_max_to_keep", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MtcConfig.{name} must be an int >= {minimum}, got {value!r}.")
    if self.local_directory is not None and not os.path.isabs(self.local_directory):
      raise ValueError("MtcConfig.local_directory must be an absolute path on the host's RAM "
                       f"disk (e.g. /dev/shm/pax-ckpt), got {self.local_directory!r}.")
    if self.replica_axis is not None and not self.replica_axis:
      raise ValueError("MtcConfig.replica_axis must be a mesh axis name or None.")

  def resolved_local_directory(self) -> str:
    """The RAM-disk folder to use.

    Returns:
      `local_directory`, else the value of ORBAX_MTC_LOCAL_DIR.

    Raises:
      ValueError: If neither is set.
    """
    directory = self.local_directory or os.environ.get("ORBAX_MTC_LOCAL_DIR")
    if not directory:
      raise ValueError("No RAM-disk folder for the local tier: pass "
                       "--mtc_local_checkpoint_dir=/dev/shm/<run> (one folder per host).")
    return directory


def _total_num_params(train_state: Any) -> int:
  mdl_vars = checkpoint_manager._field(train_state, "mdl_vars")
  tree = mdl_vars if mdl_vars is not None else train_state
  return int(sum(getattr(x, "size", 0) for x in jax.tree_util.tree_leaves(tree)))


class PaxTrainingCheckpointer:
  """Pax's pjit training checkpointer interface, backed by `PaxCheckpointManager`.

  Building it agrees the step to restore with every process (one all-gather), so every
  process constructs it at the same point.

  Args:
    checkpoint_manager: The manager it drives.
    checkpoint_type: Pax's checkpoint type, handed back to Pax's partitioner.
    enable_checkpoint_saving: False makes every save a no-op.
    external_restore_fn: `fn(metadata, partitioner, train_input_pipeline) -> train_state`,
      used when neither tier has a step (Pax's `task.train.external_checkpoint_path`).

  Attributes:
    checkpoint_manager: The manager it drives.
  """

  def __init__(self, checkpoint_manager: PaxCheckpointManager, checkpoint_type: Any = None,
               enable_checkpoint_saving: bool = True,
               external_restore_fn: Callable[[Any, Any, Any], Any] | None = None):
    self.checkpoint_manager = checkpoint_manager
    self._checkpoint_type = checkpoint_type
    self._enable_checkpoint_saving = enable_checkpoint_saving
    self._external_restore_fn = external_restore_fn
    self._step_to_restore = self._agreed_latest_step()

  def _agreed_latest_step(self) -> int | None:
    """The newest step in every process's view (one all-gather): Pax's `step_to_restore`
    before `get_model_states`, the same on every process. `get_model_states` restores the
    newest step the job can assemble (a peer may fill in for a node's lost RAM step) and
    `step_to_restore` then names that step."""
    mine = set(self.checkpoint_manager.all_steps())
    if jax.process_count() == 1:
      return max(mine) if mine else None
    import numpy as np
    from jax.experimental import multihost_utils

    width = 64
    row = np.full((width,), -1, dtype=np.int64)
    newest = sorted(mine)[-width:]
    row[:len(newest)] = newest
    rows = np.asarray(multihost_utils.process_allgather(row))
    common = set.intersection(*({int(s) for s in r if s >= 0} for r in rows))
    return max(common) if common else None

  @property
  def step_to_restore(self) -> int | None:
    """The step restored (after `get_model_states`), else the newest step all processes see."""
    return self._step_to_restore

  @property
  def checkpoint_type(self) -> Any:
    """Pax's checkpoint type, as given."""
    return self._checkpoint_type

  @property
  def last_restore(self):
    """The manager's `last_restore` (None before the orbax-mtc manager is built)."""
    return self.checkpoint_manager.last_restore

  @property
  def last_ondemand(self):
    """The manager's `last_ondemand` (None before the orbax-mtc manager is built)."""
    return self.checkpoint_manager.last_ondemand

  def wait_until_finished(self) -> None:
    """Waits for the saves in flight."""
    self.checkpoint_manager.wait_until_finished()

  def reached_preemption(self, step: int) -> bool:
    """Whether `step` is the agreed on-demand step after a SIGTERM (Pax then exits).

    Args:
      step: The current step.

    Returns:
      True at that step.
    """
    return self.checkpoint_manager.reached_preemption(step)

  def _save(self, step_i: int, train_state: Any, unpadded: Any, train_input_pipeline: Any,
            force: bool) -> None:
    if not self._enable_checkpoint_saving:
      return
    self.checkpoint_manager.save(step_i, train_state, unpadded, train_input_pipeline,
                                 force=force)

  def save_if_needed(self, step_i: int, partitioned_train_state: Any,
                     train_state_unpadded_shape_dtype_struct: Any = None,
                     train_state_pspecs: Any = None, train_input_pipeline: Any = None) -> None:
    """Saves `step_i` if a tier's schedule or a preemption asks for it.

    Every process calls this at the top of every step. A failed persistent backup is logged
    and training goes on (`close()` reports it).

    Args:
      step_i: The current step.
      partitioned_train_state: The train state.
      train_state_unpadded_shape_dtype_struct: Unpadded shapes and dtypes for the metadata.
      train_state_pspecs: Accepted and ignored.
      train_input_pipeline: Must be None: the input pipeline is not checkpointed.

    Raises:
      ValueError: If `train_input_pipeline` is given, or the manager cannot be built.
    """
    del train_state_pspecs
    if self.checkpoint_manager.mtc_manager is None:
      # Pax always calls get_model_states first; a loop that did not still needs the
      # collective build at the same point on every process.
      self.checkpoint_manager.build_for(partitioned_train_state)
    if not self.checkpoint_manager.should_save(step_i):
      return
    self._save(step_i, partitioned_train_state, train_state_unpadded_shape_dtype_struct,
               train_input_pipeline, force=False)
    try:
      self.checkpoint_manager.check_for_errors()
    except orbax_mtc.BackupError as e:
      # Pax stops on any checkpoint error; here the step is safe in RAM and on peers and the
      # next scheduled backup retries, so training goes on (close() still reports it).
      logging.warning("pax_patch: %s Training goes on.", e)

  def save_final(self, step_i: int, *, partitioned_train_state: Any,
                 train_state_unpadded_shape_dtype_struct: Any = None,
                 train_state_pspecs: Any = None, train_input_pipeline: Any = None) -> None:
    """Saves the last step to every tier unless it is already saved.

    Args:
      step_i: The last step.
      partitioned_train_state: The train state.
      train_state_unpadded_shape_dtype_struct: Unpadded shapes and dtypes for the metadata.
      train_state_pspecs: Accepted and ignored.
      train_input_pipeline: Must be None: the input pipeline is not checkpointed.

    Raises:
      ValueError: If `train_input_pipeline` is given, or the manager cannot be built.
    """
    del train_state_pspecs
    latest = self.checkpoint_manager.latest_step()
    if latest is None or latest < step_i:
      logging.info("pax_patch: saving the final step %d", step_i)
      self._save(step_i, partitioned_train_state, train_state_unpadded_shape_dtype_struct,
                 train_input_pipeline, force=True)

  def get_model_states(self, partitioner: Any, metadata: Any, root_prng_key: Any,
                       train_input_pipeline: Any = None) -> tuple[Any, Any, int, Any]:
    """Restores the newest step the whole job can assemble, or initialises.

    RAM first, then persistent, then `external_restore_fn`; the partitioner initialises
    whatever is not restored. Builds the orbax-mtc manager (collective).

    Args:
      partitioner: Pax's partitioner (its `global_mesh` and
        `initialize_prng_key_and_train_state`).
      metadata: Pax's train state metadata (padded and unpadded shapes, partition specs).
      root_prng_key: The root PRNG key.
      train_input_pipeline: Must be None: the input pipeline is not checkpointed.

    Returns:
      Pax's (train_state, provenance, number of parameters, root_prng_key).

    Raises:
      ValueError: If `train_input_pipeline` is given, or the saved Pax metadata does not
        match the model.
    """
    global_mesh = partitioner.global_mesh
    target = checkpoint_manager._with_shardings(metadata.padded_global_shapes,
                                                metadata.partition_specs, global_mesh)
    self.checkpoint_manager.build(global_mesh, target)
    train_state = self.checkpoint_manager.restore(
        None, target, metadata.unpadded_global_shapes, train_input_pipeline)
    info = self.checkpoint_manager.last_restore
    self._step_to_restore = info.step if info is not None else None
    if train_state is None and self._external_restore_fn is not None:
      train_state = self._external_restore_fn(metadata, partitioner, train_input_pipeline)
    root_prng_key, train_state, provenance = partitioner.initialize_prng_key_and_train_state(
        root_prng_key, train_state, self._checkpoint_type)
    return train_state, provenance, _total_num_params(train_state), root_prng_key

  def close(self) -> None:
    """Waits for the saves in flight and closes the manager (reporting a failed backup)."""
    self.checkpoint_manager.wait_until_finished()
    self.checkpoint_manager.close()


_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | None) -> datetime.timedelta | None:
  """Parses Pax's `save_keep_interval_duration`: '90', '30s', '15m', '2h' or '1d'.

  Args:
    text: The duration; None or empty for none.

  Returns:
    The duration, or None.

  Raises:
    ValueError: If `text` is not seconds or a number with s, m, h or d.
  """
  if not text:
    return None
  match = _DURATION.match(str(text).strip())
  if match is None:
    raise ValueError(f"Cannot parse the duration {text!r}: use seconds, or a number with "
                     "s, m, h or d (e.g. '12h').")
  return datetime.timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def _type_name(checkpoint_type: Any) -> str:
  return str(getattr(checkpoint_type, "name", checkpoint_type)).upper()


def create_checkpointer(task_p: Any, job_log_dir: epath.PathLike, checkpoint_type: Any,
                        todelete_subdir: str | None = None, train_input_p: Any = None,
                        enable_async_checkpointing: bool = True,
                        enable_checkpoint_saving: bool = True,
                        enforce_restore_shape_check: bool = False,
                        maybe_use_persistence_checkpointing: bool = False,
                        tensorstore_use_ocdbt: bool = False,
                        async_timeout_secs: int | None = None, *,
                        config: MtcConfig | None = None,
                        external_restore_fn: Callable[[Any, Any, Any], Any] | None = None
                        ) -> PaxTrainingCheckpointer:
  """Pax's `_create_checkpointer`, on orbax-mtc (see the module docstring).

  Args:
    task_p: Pax's task config; `task_p.train` gives the persistent schedule and retention.
    job_log_dir: Pax's job folder; checkpoints go to `<job_log_dir>/checkpoints`.
    checkpoint_type: Pax's checkpoint type; only GDA is supported.
    todelete_subdir: Accepted and ignored (deletion is orbax-mtc's).
    train_input_p: Accepted and ignored (no input checkpointing).
    enable_async_checkpointing: Write in the background.
    enable_checkpoint_saving: False makes every save a no-op.
    enforce_restore_shape_check: Does not apply (warned).
    maybe_use_persistence_checkpointing: Does not apply (warned).
    tensorstore_use_ocdbt: Accepted; the persistent checkpoints are OCDBT either way.
    async_timeout_secs: Bound on one persistent write; None for Pax's default (6 h).
    config: The orbax-mtc side (RAM tier, peers); None for `MtcConfig()`.
    external_restore_fn: Restores Pax's external checkpoint when neither tier has a step.

  Returns:
    The `PaxTrainingCheckpointer`.

  Raises:
    ValueError: If the model is not pjit (no `ici_mesh_shape`), the checkpoint type is not
      GDA, input checkpointing or restore transformations are set, no RAM-disk folder is
      given, or an option is invalid.
  """
  del todelete_subdir, train_input_p  # deletion is orbax-mtc's; no input checkpointing
  config = config or MtcConfig()
  train_p = task_p.train
  if getattr(task_p.model, "ici_mesh_shape", None) is None:
    raise ValueError("pax_patch supports pjit (SPMD) models, whose task sets "
                     "model.ici_mesh_shape; this model runs under pmap. Run paxml.main "
                     "without pax_patch for it.")
  if _type_name(checkpoint_type) not in ("GDA", "CHECKPOINTTYPE.GDA"):
    raise ValueError(f"pax_patch writes Orbax (GDA) checkpoints; checkpoint type "
                     f"{checkpoint_type} is not supported (drop "
                     "--maybe_use_persistence_checkpointing).")
  if getattr(train_p, "enable_input_checkpointing", False):
    raise ValueError("pax_patch does not checkpoint the input pipeline: set "
                     "task.train.enable_input_checkpointing=False.")
  if getattr(train_p, "restore_transformations", None):
    raise ValueError("pax_patch cannot apply restore_transformations: unset "
                     "task.train.restore_transformations.")
  if enforce_restore_shape_check or maybe_use_persistence_checkpointing:
    logging.warning("pax_patch: enforce_restore_shape_check / "
                    "maybe_use_persistence_checkpointing do not apply (restore targets must "
                    "match the saved shapes exactly).")
  if not tensorstore_use_ocdbt:
    logging.info("pax_patch: persistent checkpoints are OCDBT (Pax version %s); Pax's own "
                 "tools read them with --tensorstore_use_ocdbt=1.",
                 checkpoint_manager.PAX_CHECKPOINT_VERSION)
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=getattr(train_p, "save_interval_steps", None) or 1,
      max_to_keep=getattr(train_p, "save_max_to_keep", None),
      keep_time_interval=parse_duration(getattr(train_p, "save_keep_interval_duration", None)))
  manager = PaxCheckpointManager(
      epath.Path(job_log_dir) / "checkpoints",
      local_directory=config.resolved_local_directory(), options=options,
      local_save_interval_steps=config.local_save_interval_steps,
      local_max_to_keep=config.local_max_to_keep, peers_per_node=config.peers_per_node,
      replica_axis=config.replica_axis, enable_async_checkpointing=enable_async_checkpointing,
      async_timeout_secs=async_timeout_secs or PAX_ASYNC_TIMEOUT_SECS,
      ondemand_grace_seconds=config.ondemand_grace_seconds)
  checkpoint_manager.log_layout(manager)
  return PaxTrainingCheckpointer(manager, checkpoint_type,
                                 enable_checkpoint_saving=enable_checkpoint_saving,
                                 external_restore_fn=external_restore_fn)
