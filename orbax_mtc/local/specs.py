"""Leaves and their records: how a pytree leaf's spec maps to what the manifest stores.

PRNG key dtypes (a key leaf is stored as its key data: `stored_spec`; a restore target states
it as keys again: `saved_spec`), shard indices, sharding descriptions, key paths, and the
items' metadata rebuilt from a manifest without a target tree. The manifest itself, and how a
key leaf appears in it, is `format`'s part.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from orbax.checkpoint import args as ocp_args

from orbax_mtc.local.format import Index, LeafRecord, ManifestError, StepManifest, np_dtype

_MAX_DESCRIPTION = 1000  # characters of a sharding description kept in the manifest


# ----------------------------------------------------------------------------- PRNG keys


def is_key_dtype(dtype: Any) -> bool:
  """Whether `dtype` is a typed PRNG key dtype (key<fry>, key<urbg>...)."""
  try:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  except TypeError:
    return False


@functools.lru_cache(maxsize=64)
def key_spec(impl: str) -> tuple[Any, tuple[int, ...], np.dtype]:
  """The specs of one key of a PRNG implementation.

  Args:
    impl: the implementation, named as `str(jax.random.key_impl(key))` names it.

  Returns:
    (key dtype, key data shape, key data dtype).

  Raises:
    ValueError: this JAX lacks the implementation.
  """
  try:
    key = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl))
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(f"PRNG implementation {impl!r} is unknown to this JAX ({jax.__version__})"
                     f": {e}") from e
  data = jax.eval_shape(jax.random.key_data, key)
  return key.dtype, tuple(data.shape), np.dtype(data.dtype)


@functools.lru_cache(maxsize=64)
def key_data_dims(dtype: Any) -> tuple[int, ...]:
  """The dimensions a key dtype's data adds after the key array's own; () for other dtypes."""
  if not is_key_dtype(dtype):
    return ()
  return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape)


def stored_spec(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
  """The shape and dtype a leaf of `shape` and `dtype` is stored as (here and by Orbax): a
  PRNG key leaf as its key data, other leaves as they are."""
  if is_key_dtype(dtype):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype))
    return tuple(data.shape), np.dtype(data.dtype)
  return tuple(shape), np.dtype(dtype)


def saved_spec(record: LeafRecord) -> tuple[tuple[int, ...], Any, tuple[int, ...]]:
  """A saved leaf's spec as a restore target states it.

  Args:
    record: the leaf.

  Returns:
    (shape, dtype, key data dims): for a PRNG key leaf the key array's shape and key dtype, and
    the dims its data adds; for others the stored shape and dtype, and ().

  Raises:
    ValueError: this JAX lacks the key implementation, or the stored data is not the key data
      of that implementation.
  """
  if record.key_impl is None:
    return tuple(record.shape), np_dtype(record.dtype), ()
  key_dtype, data_dims, data_dtype = key_spec(record.key_impl)
  n = len(record.shape) - len(data_dims)
  if n < 0 or tuple(record.shape[n:]) != data_dims or np_dtype(record.dtype) != data_dtype:
    raise ValueError(f"its data, shape {tuple(record.shape)} dtype {record.dtype}, is not "
                     f"{record.key_impl!r} key data (shape (...) + {data_dims}, dtype "
                     f"{data_dtype.name})")
  return tuple(record.shape[:n]), key_dtype, data_dims


# ----------------------------------------------------------------------------- indices, trees


def whole_index(dims: Sequence[int]) -> Index:
  """The index of a whole array of shape `dims`."""
  return tuple((0, n) for n in dims)


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
  """A shard's global index as ((start, stop), ...) with no None bounds.

  Args:
    index: the shard's index, one slice per dimension (as jax's `Shard.index`).
    shape: the global shape.

  Raises:
    ValueError: a slice has a step other than 1.
  """
  out = []
  for sl, dim in zip(index, shape, strict=True):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {sl} is not supported")
    out.append((start, stop))
  return tuple(out)


@functools.lru_cache(maxsize=4096)
def global_tiles(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
                 ) -> tuple[tuple[Index, tuple[int, ...]], ...]:
  """Every distinct shard index of `sharding` over `shape` and the processes holding it.

  The step's global layout, written to each manifest so that an elastic restore can find
  every shard without the old mesh. Cached: leaves share a few shardings, and a save must not
  walk every device of every leaf each time.

  Args:
    sharding: the saved array's sharding (hashable, as JAX's shardings are).
    shape: the saved array's shape (for a PRNG key leaf, its key data's).

  Returns:
    (index, ascending process indices), in the order of first appearance.
  """
  holders: dict[Index, set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    holders.setdefault(normalize_index(index, shape), set()).add(int(device.process_index))
  return tuple((index, tuple(sorted(ps))) for index, ps in holders.items())


def describe_sharding(sharding: Any) -> str:
  """A readable description of a sharding, for the manifest and for error messages."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    # The device order too: the same axes over devices in another order place other shards
    # on each process (another mesh layout), which the axes alone would not tell.
    devices = [int(d.id) for d in sharding.mesh.devices.flat]
    text = (f"NamedSharding(mesh={dict(sharding.mesh.shape)!r}, spec={sharding.spec!r}, "
            f"devices={devices})")
  else:
    text = repr(sharding)
  return text if len(text) <= _MAX_DESCRIPTION else text[:_MAX_DESCRIPTION - 3] + "..."


def encode_key_path(key_path: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
  """A leaf's key path as the manifest's `keys`: (kind, key) pairs, kind one of "dict",
  "seq", "attr" or "flat" (custom nodes)."""
  out = []
  for key in key_path:
    if isinstance(key, jax.tree_util.DictKey):
      out.append(("dict", key.key if isinstance(key.key, (str, int)) else str(key.key)))
    elif isinstance(key, jax.tree_util.SequenceKey):
      out.append(("seq", key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      out.append(("attr", key.name))
    else:
      out.append(("flat", getattr(key, "key", str(key))))
  return tuple(out)


def item_metadata(manifest: StepManifest) -> Any:
  """The saved items' structure, rebuilt from a manifest (no target needed).

  Attribute and custom-node keys become dict keys; JSON items give their value; PRNG key
  leaves have their key shape and key dtype.

  Args:
    manifest: the step's manifest.

  Returns:
    Nested dicts/lists of jax.ShapeDtypeStruct: the single item of a step saved from one
    argument, else an `ocp.args.Composite` of the items.

  Raises:
    ManifestError: the leaves' key paths contradict each other, or a leaf holds PRNG keys of
      an implementation this JAX lacks.
  """
  result: dict[str, Any] = {}
  for name, item in manifest.items.items():
    if item.kind == "json":
      result[name] = item.value
      continue
    if item.kind == "process":  # as Orbax's metadata of Grain's items: none
      result[name] = None
      continue
    root: Any = None
    for leaf in item.leaves:
      try:
        shape, dtype, _ = saved_spec(leaf)
      except ValueError as e:
        raise ManifestError(f"item {name!r}: leaf {leaf.path!r} holds PRNG keys: {e}") from e
      spec = jax.ShapeDtypeStruct(shape, dtype)
      if not leaf.keys:
        if root is not None:
          raise ManifestError(f"item {name!r}: leaf {leaf.path!r} has no key path but the item "
                              "has other leaves")
        root = spec
        continue
      if root is None:
        root = {}
      node = root
      for i, (_, key) in enumerate(leaf.keys):
        if not isinstance(node, dict):
          raise ManifestError(f"item {name!r}: the key path of leaf {leaf.path!r} runs "
                              "through another leaf")
        if i == len(leaf.keys) - 1:
          node[key] = spec
        else:
          node = node.setdefault(key, {})
    result[name] = _lists_from_int_keys(root)
  if manifest.default_item and list(result) == ["default"]:
    return result["default"]
  return ocp_args.Composite(**result)


def _lists_from_int_keys(node: Any) -> Any:
  if isinstance(node, dict):
    node = {k: _lists_from_int_keys(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
      return [node[i] for i in range(len(node))]
  return node
