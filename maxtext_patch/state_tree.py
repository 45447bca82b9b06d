"""The training state as the multi-tier managers save it: nested dicts keyed by field names.

`_checkpoint_tree` turns a Linen `TrainState`, an NNX state or any pytree into nested dicts (the
same tree in every tier, and in a plain Orbax checkpoint); `_from_checkpoint_tree` puts the
leaves back into the caller's structure. `_as_pytree` gives an NNX module's state and
`_state_step` a state's step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _checkpoint_tree(tree: Any) -> dict[str, Any]:
  """The leaves of `tree` as nested dicts keyed by dict keys, attribute names and indices.

  Why: Orbax writes dataclass and namedtuple nodes as dicts, so a persistent checkpoint read
  back against a `TrainState` target does not match it leaf for leaf; nested dicts are the
  same tree in every tier.
  """
  out: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [_key_name(k) for k in path] or ["value"]
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise ValueError(f"State leaf path {jax.tree_util.keystr(path)} clashes with another "
                         "leaf of the same name.")
    if keys[-1] in node:
      raise ValueError(f"Two state leaves map to the name {jax.tree_util.keystr(path)}.")
    node[keys[-1]] = leaf
  return out


def _from_checkpoint_tree(nested: Mapping[str, Any], like: Any) -> Any:
  """`_checkpoint_tree`'s inverse: the leaves of `nested` put back into `like`'s structure."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  leaves = []
  for path, _ in paths:
    node: Any = nested
    for key in [_key_name(k) for k in path] or ["value"]:
      node = node[key]
    leaves.append(node)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_pytree(state: Any) -> Any:
  """An NNX train state (a Module, MaxText's `TrainStateNNX`) as its `nnx.State`; other
  states as they are."""
  try:
    from flax import nnx
  except ImportError:
    return state
  return nnx.state(state) if isinstance(state, nnx.Module) else state


def _state_step(state: Any) -> int:
  """`state.step` of a Linen TrainState, a dict or an NNX optimizer state."""
  for get in (lambda s: s.step, lambda s: s["step"], lambda s: s.optimizer.step):
    try:
      return int(get(state))
    except (AttributeError, KeyError, TypeError):
      continue
  raise ValueError("Cannot find the step of the training state (state.step, state['step'] or "
                   "state.optimizer.step); pass step= to maybe_save_checkpoint.")
