"""Restore from the persistent tier: Orbax's own restore, with the RAM tier's clear errors.

The persistent tier is a standard Orbax checkpoint, so Orbax restores it (on any topology),
casting a leaf to the target's dtype as it always does (the RAM tier casts the same way).
Before that, the target is checked against the saved tree's metadata, leaf by leaf: Orbax
alone would raise an error that does not name the leaf. The checks
read the step's folder on each process (on Cloud Storage a read can fail on one host), so
their outcome is agreed before any process enters Orbax's restore and its barriers (rule 9).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_mtc import agreement, item_args, process_state
from orbax_mtc.agreement import BuildRecord, Status
from orbax_mtc.local import cast as local_cast
from orbax_mtc.local import format as local_format
from orbax_mtc.local import specs as local_specs
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.restore.outcome import Outcome


def restore(persistent: PersistentTier, step: int, targets: dict[str, Any],
            single: bool | None, agree: Callable[[BuildRecord, str], Outcome]) -> Any:
  """Restores `step` from the persistent tier (collective).

  Args:
    persistent: the persistent tier.
    step: a persistent step every process sees.
    targets: item name -> target tree (None: a JSON item).
    single: a single-item restore (None: as the step was saved).
    agree: the agreement on the checks' outcome (restore/outcome.agree: reductions).

  Returns:
    The restored item, or an `ocp.args.Composite` of items.

  Raises (on every process alike):
    local_format.MissingItemError: the step holds no such item.
    local_format.AbstractStateMismatchError: the targets do not match what was saved.
    agreement.CheckpointError: a check failed on some process for another reason (an I/O
      error reading the step's metadata); nothing was restored.
  """
  outcome, checked = Status.OK, (targets, single)
  try:
    checked = _checked(persistent, step, targets, single)
    message = ""
  except local_format.AbstractStateMismatchError as e:
    outcome, message = Status.MISMATCH, str(e)
  except Exception as e:  # noqa: BLE001 - agreed below, raised on every process
    outcome, message = Status.FAILED, f"{type(e).__name__}: {e}"
  agreed = agree(BuildRecord(status=outcome, message=message, in_place=True),
                 f"checking persistent step {step}")
  if Status.MISMATCH in agreed.said:
    raise _as_raised(*agreed.said[Status.MISMATCH])
  if not agreed.ok:
    what = f"reading persistent step {step}'s metadata"
    if agreed.counts[Status.FAILED] > len(agreed.failed):
      what += f" ({agreed.counts[Status.FAILED]} processes; the lowest named)"
    raise agreement.CheckpointError(what, dict(agreed.failed))
  targets, single = checked

  def restore_arg(target):
    if target is None:
      return ocp.args.JsonRestore()
    if isinstance(target, process_state.ProcessTarget):
      return process_state.restore_args(target)
    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))

  if single:
    return persistent.restore(step, restore_arg(targets[item_args.DEFAULT_ITEM]))
  return persistent.restore(step, ocp.args.Composite(
      **{name: restore_arg(t) for name, t in targets.items()}))


def _as_raised(process: int, message: str) -> local_format.AbstractStateMismatchError:
  """The agreed mismatch of `process`, raised alike everywhere (the same type it was)."""
  if message.startswith("Item '") and " is not in persistent step " in message:
    return local_format.MissingItemError(message, message.split("'")[1])
  return local_format.AbstractStateMismatchError(
      message if process == jax.process_index() else f"process {process}: {message}")


def _checked(persistent: PersistentTier, step: int, targets: dict[str, Any],
             single: bool | None) -> tuple[dict[str, Any], bool]:
  """The targets as the step was saved, each checked against its metadata (this process's
  reads). Raises as `restore`."""
  step_dir = persistent.step_directory(step)
  saved_items = sorted(p.name for p in step_dir.iterdir() if p.is_dir()) \
      if step_dir.is_dir() else []
  if single is None:
    single = saved_items == [item_args.DEFAULT_ITEM]
    targets = item_args.as_saved(targets, single)
  for name, target in targets.items():
    if name not in saved_items:
      raise local_format.MissingItemError(
          f"Item {name!r} is not in persistent step {step} (it holds {saved_items}).", name)
    if isinstance(target, process_state.ProcessTarget):
      check_process_item(step_dir / name, name)
    elif target is not None:
      check_item(step_dir / name, name, target)
  return targets, single


def check_process_item(item_dir: epath.Path, name: str) -> None:
  """Raises a clear error when a process's file of a per-process item is missing (saved by
  another process count), before Orbax's restore starts: every process checks every
  process's file, so all raise together, and none waits in Orbax's restore for one that did.

  Raises:
    local_format.AbstractStateMismatchError: a file is not there.
  """
  count = jax.process_count()
  try:
    present = {p.name for p in item_dir.iterdir()}
  except OSError:
    present = set()
  missing = [i for i in range(count) if process_state.file_name(i, count) not in present]
  if missing:
    raise local_format.AbstractStateMismatchError(
        f"Item {name!r}: " + process_state.missing_message(item_dir, missing[0], count))


def check_item(item_dir: epath.Path, name: str, target: Any) -> None:
  """Raises the RAM tier's clear error for a target that does not match the saved tree.

  Raises:
    local_format.AbstractStateMismatchError: a leaf is missing, its shape differs, or its
      dtype differs and cannot be cast (a PRNG key leaf is never cast).
  """
  with ocp.PyTreeCheckpointer() as checkpointer:
    saved = checkpointer.metadata(item_dir)
  saved_tree = getattr(getattr(saved, "item_metadata", None), "tree", saved)
  saved_leaves = {item_args.plain_path(p): leaf
                  for p, leaf in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
    path = item_args.plain_path(key_path)
    meta = saved_leaves.get(path)
    if meta is None:
      raise local_format.AbstractStateMismatchError(
          f"Leaf {name}{path} of the restore target is not in the persistent checkpoint "
          f"{item_dir} (it holds {sorted(saved_leaves)[:8]}).")
    if not hasattr(leaf, "shape") or not hasattr(meta, "shape"):
      continue  # Python scalars and other non-array leaves carry no shape to compare
    # Orbax stores (and describes) a PRNG key leaf as its key data.
    want_shape, want_dtype = local_specs.stored_spec(leaf.shape, leaf.dtype)
    have_shape, have_dtype = tuple(meta.shape), np.dtype(meta.dtype)
    cast_ok = not local_specs.is_key_dtype(leaf.dtype) and local_cast.castable(have_dtype,
                                                                                want_dtype)
    if want_shape != have_shape or (want_dtype != have_dtype and not cast_ok):
      asked = f"shape {want_shape} dtype {want_dtype.name}"
      if local_specs.is_key_dtype(leaf.dtype):
        asked = f"shape {tuple(leaf.shape)} dtype {leaf.dtype.name} (stored as {asked})"
      raise local_format.AbstractStateMismatchError(
          f"Leaf {name}{path}: the persistent checkpoint holds shape {have_shape} dtype "
          f"{have_dtype.name}, but the target asks for {asked}. Pass an abstract state that "
          "matches the saved one.")
