"""Orbax save/restore args translated for the RAM tier (pure: no I/O, no collective).

A save is `args=ocp.args.Composite(name=PyTreeSave(tree), other=JsonSave(obj))` or a single
`PyTreeSave`/`StandardSave`, which Orbax stores as its default item. The RAM tier holds pytree
items (arrays, numpy, scalars), JSON items and per-process items (`process_state`: a data
iterator's position); restore targets name each item's abstract tree (None for JSON, a
`ProcessTarget` for a per-process item).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from orbax_mtc import process_state

PYTREE_SAVE = (ocp.args.PyTreeSave, ocp.args.StandardSave)
PYTREE_RESTORE = (ocp.args.PyTreeRestore, ocp.args.StandardRestore)
DEFAULT_ITEM = "default"  # Orbax's folder name for a single-item checkpoint
STATE_ITEM = "state"  # the item name a restore without args builds from abstract_state


# Orbax's emergency manager keeps its own per-process metadata under this item name and
# refuses it from users; code written for that manager must meet the same answer here.
RESERVED_ITEM = "process_metadata"


def save_args_of(items: Any, args: Any) -> Any:
  """A multi-tier save's args (Orbax's older `items` form converted).

  Raises:
    ValueError: neither given, or an item named `process_metadata` (as Orbax's emergency
      manager).
  """
  if args is None:
    if items is None:
      raise ValueError("Must provide `args` for `save`.")
    args = items if isinstance(items, ocp.args.CheckpointArgs) else ocp.args.PyTreeSave(items)
  if isinstance(args, ocp.args.Composite) and RESERVED_ITEM in args.keys():
    raise ValueError(
        f"{RESERVED_ITEM!r} is a reserved item name (Orbax's emergency CheckpointManager "
        "keeps its per-process metadata under it): give the item another name.")
  return args


def restore_args_of(items: Any, args: Any) -> Any:
  """A restore's args (Orbax's older `items` form converted)."""
  if items is not None and args is None:
    return items if isinstance(items, ocp.args.CheckpointArgs) else ocp.args.PyTreeRestore(items)
  return args


def named_items(args: Any) -> dict[str, Any]:
  """Item name -> args of one item (a single-item call is Orbax's default item)."""
  return dict(args.items()) if isinstance(args, ocp.args.Composite) else {DEFAULT_ITEM: args}


def split_save_args(args: Any, *, on_process_error: Callable[[Exception], Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, bytes]], bool]:
  """Splits Orbax save args into what the RAM tier writes.

  A per-process item's state is taken now, when `save` is called (a data iterator moves on
  as soon as it returns).

  Args:
    args: `ocp.args.Composite` of PyTreeSave/StandardSave/JsonSave items and per-process
      items (ProcessJsonSave, Grain's CheckpointSave), or one PyTreeSave/StandardSave.
    on_process_error: gets the error of a per-process value this process cannot encode
      (the item is then left out) instead of it being raised: the value is this process's
      own, so the other processes may have nothing to raise, and the caller reports it
      through an agreement.

  Returns:
    (pytree items, JSON items, per-process items as (format, this process's bytes), whether
    it was a single default item).

  Raises:
    TypeError: an item kind the RAM tier cannot hold, args of another kind, or (without
      `on_process_error`) a per-process value that is not JSON or not a Grain iterator.
    RuntimeError: (without `on_process_error`) a Grain iterator's get_state() failed.
  """
  if isinstance(args, PYTREE_SAVE):
    return {DEFAULT_ITEM: args.item}, {}, {}, True
  if isinstance(args, ocp.args.Composite):
    trees, jsons, processes = {}, {}, {}
    for name, item in args.items():
      fmt = process_state.save_format(item)
      if isinstance(item, PYTREE_SAVE):
        trees[name] = item.item
      elif isinstance(item, ocp.args.JsonSave):
        jsons[name] = item.item
      elif fmt is not None:
        try:
          processes[name] = (fmt, process_state.encode(fmt, item.item))
        except Exception as e:  # noqa: BLE001 - a state getter may fail any way
          error = TypeError(f"Item {name!r}: {e}") if isinstance(e, TypeError) else \
              RuntimeError(f"Item {name!r}: {type(e).__name__}: {e}")
          if on_process_error is None:
            raise error from e
          on_process_error(error)
      else:
        raise TypeError(
            f"Item {name!r}: {type(item).__name__} cannot be saved to the RAM tier, which "
            "holds PyTreeSave/StandardSave, JsonSave and per-process items (ProcessJsonSave, "
            "Grain's CheckpointSave). Save it with a plain ocp.CheckpointManager, or convert "
            "it to a pytree of arrays.")
    return trees, jsons, processes, False
  raise TypeError(
      f"save() needs args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)) or "
      f"ocp.args.PyTreeSave(state) / StandardSave(state); got {type(args).__name__}.")


def restore_targets(args: Any, abstract_state: Any) -> tuple[dict[str, Any], bool | None]:
  """What a restore builds, item by item.

  Args:
    args: Orbax restore args, or None to restore `abstract_state`.
    abstract_state: the manager's abstract state (may be None).

  Returns:
    (item name -> target pytree, None for a JSON item or a `process_state.ProcessTarget`
    for a per-process item; True for a single-item restore,
    False for Composite, None when args were omitted and the saved layout decides).

  Raises:
    TypeError: an args kind the RAM tier cannot restore.
    ValueError: nothing says what to build.
  """
  if args is None:
    if abstract_state is None:
      raise ValueError("restore() needs args or an abstract_state given to the manager.")
    return {STATE_ITEM: abstract_state}, None
  if isinstance(args, PYTREE_RESTORE):
    return {DEFAULT_ITEM: args.item if args.item is not None else abstract_state}, True
  if isinstance(args, ocp.args.Composite):
    targets = {}
    for name, item in args.items():
      if isinstance(item, PYTREE_RESTORE):
        targets[name] = item.item if item.item is not None else abstract_state
      elif isinstance(item, ocp.args.JsonRestore):
        targets[name] = None
      elif (fmt := process_state.restore_format(item)) is not None:
        if fmt == process_state.GRAIN and item.item is None:
          raise ValueError(f"Item {name!r}: Grain's CheckpointRestore needs the iterator to "
                           "restore into: CheckpointRestore(iterator).")
        targets[name] = process_state.ProcessTarget(
            fmt, item.item if fmt == process_state.GRAIN else None)
      else:
        raise TypeError(f"Item {name!r}: {type(item).__name__} is not supported by the "
                        "RAM tier restore (PyTreeRestore/StandardRestore/JsonRestore, "
                        "ProcessJsonRestore, Grain's CheckpointRestore).")
      if targets[name] is None and not isinstance(item, ocp.args.JsonRestore):
        raise ValueError(f"Item {name!r}: give PyTreeRestore(item=abstract_tree) or an "
                         "abstract_state to the manager.")
    return targets, False
  raise TypeError(f"restore() args must be Composite, PyTreeRestore or StandardRestore; got "
                  f"{type(args).__name__}.")


def as_saved(targets: dict[str, Any], default_item: bool) -> dict[str, Any]:
  """Targets of a restore without args, renamed as the step was saved (single item or not)."""
  if default_item and STATE_ITEM in targets and len(targets) == 1:
    return {DEFAULT_ITEM: targets[STATE_ITEM]}
  return targets


def process_targets(targets: dict[str, Any]) -> dict[str, process_state.ProcessTarget]:
  """The per-process items among restore targets."""
  return {name: t for name, t in targets.items()
          if isinstance(t, process_state.ProcessTarget)}


def is_array_target(leaf: Any) -> bool:
  """A leaf the RAM tier can build as a jax.Array: an array, or a ShapeDtypeStruct with a
  sharding."""
  if isinstance(leaf, jax.Array):
    return True
  return isinstance(leaf, jax.ShapeDtypeStruct) and isinstance(
      getattr(leaf, "sharding", None), jax.sharding.Sharding)


def plain_path(key_path: Any) -> str:
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
