"""Which parent-style save and restore args the RAM tier can serve exactly as Orbax would (pure).

The RAM tier keeps arrays as saved and casts them where Orbax would (a `StandardRestore` target
of another dtype); Orbax's args can ask for more (per-leaf save and restore options, reshapes,
transforms, partial restores). Anything not served here exactly goes to the parent-style
form's Orbax manager.
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp

from orbax_mtc import item_args
from orbax_mtc.local import read as local_read

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
  if isinstance(item, ocp.args.PyTreeRestore):
    # Without restore args Orbax restores the saved dtypes; StandardRestore casts to the
    # target's, as the RAM tier does.
    return jax.tree_util.tree_map(local_read.UncastLeaf, item.item)
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
