"""jax.Array helpers shared by the tiers and the integrations."""

from __future__ import annotations

from typing import Any

import jax


def abstract_leaf(leaf: Any) -> Any:
  """A jax.Array's `jax.ShapeDtypeStruct` (shape, dtype, sharding); other leaves as they are.

  Unlike `ocp.utils.to_shape_dtype_struct`, a PRNG key array keeps its key dtype, so a
  restore target built from it restores typed keys.

  Args:
    leaf: One leaf of a pytree.

  Returns:
    The `jax.ShapeDtypeStruct` of `leaf` if it is a jax.Array, else `leaf` itself.
  """
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


def abstract_tree(tree: Any) -> Any:
  """`abstract_leaf` of every leaf of `tree`: a restore target shaped and sharded like it.

  Args:
    tree: A pytree of jax.Arrays and other leaves.

  Returns:
    The same structure with every jax.Array replaced by its `jax.ShapeDtypeStruct`.
  """
  return jax.tree.map(abstract_leaf, tree)
