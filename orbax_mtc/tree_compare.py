"""Bit-for-bit comparison of pytrees, for the tests and the benchmark workers.

Dtypes, shapes and shardings must match and every byte must be equal, so a NaN payload or the
sign of -0.0 counts; PRNG key arrays are compared through their key data. `orbax_mtc.testing`
re-exports these names; nothing in the library imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def leaf_bits(x: Any):
  """The raw bytes of an array, C order, as a flat uint8 numpy array.

  Args:
    x: a numpy array, a fully addressable jax.Array (a shard's data is one) or a PRNG key
      array (its key data is taken).

  Returns:
    A 1-D uint8 numpy array.
  """
  import jax
  import numpy as np

  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.ascontiguousarray(np.asarray(x))
  return x.reshape(-1).view(np.uint8)


def _bits_differ(where: str, got: Any, want: Any) -> list[str]:
  import numpy as np

  g, w = leaf_bits(got), leaf_bits(want)
  if g.size != w.size:
    return [f"{where}: {g.size} bytes != {w.size} bytes"]
  bad = np.flatnonzero(g != w)
  if bad.size:
    return [f"{where}: bytes differ ({bad.size} of {w.size}, first at byte {bad[0]})"]
  return []


def _path_name(path: Sequence[Any]) -> str:
  """"params/w", "layers/0": the keys of a jax key path joined by '/'."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts) or "<root>"


def _flat_pairs(got: Any, want: Any) -> tuple[list[tuple[str, Any, Any]], list[str]]:
  import jax

  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  if got_def != want_def:
    return [], [f"tree structure differs: {got_def} != {want_def}"]
  return [(_path_name(path), g, w)
          for (path, g), (_, w) in zip(got_flat, want_flat, strict=True)], []


def _array_differences(where: str, got: Any, want: Any) -> list[str]:
  """A jax.Array against another: dtype, shape, sharding, then each addressable shard."""
  import jax

  if not isinstance(got, jax.Array):
    return [f"{where}: a {type(got).__name__}, not a jax.Array"]
  if got.dtype != want.dtype or got.shape != want.shape:
    return [f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"]
  if got.sharding != want.sharding:
    return [f"{where}: sharding {got.sharding} != {want.sharding}"]
  got_shards = {s.device: s for s in got.addressable_shards}
  want_shards = {s.device: s for s in want.addressable_shards}
  if set(got_shards) != set(want_shards):
    return [f"{where}: shards on {sorted(map(str, got_shards))}, expected "
            f"{sorted(map(str, want_shards))}"]
  problems = []
  for device in sorted(want_shards, key=lambda d: d.id):
    g, w = got_shards[device], want_shards[device]
    if g.index != w.index:
      problems.append(f"{where}@{device}: index {g.index} != {w.index}")
    else:
      problems += _bits_differ(f"{where}@{device}", g.data, w.data)
  if not problems and got.is_fully_addressable and want.is_fully_addressable:
    problems += _bits_differ(where, got, want)  # the global value too, where it is here
  return problems


def tree_differences(got: Any, want: Any) -> list[str]:
  """What differs between two pytrees, compared bit for bit.

  The tree structures must be equal. A jax.Array in `want` needs a jax.Array in `got` with
  the same dtype, shape and sharding, and on every addressable device a shard with the same
  index and the same bytes (so this compares a process's own shards in a multi-process job);
  where both are fully addressable the global values' bytes are compared too. A numpy array
  needs a numpy array with the same dtype, shape and bytes. Any other leaf needs a leaf of
  the same type that compares equal.

  Args:
    got: the tree to check, e.g. what a restore returned.
    want: the expected tree.

  Returns:
    One readable line per difference ("params/w@cpu:1: bytes differ (...)"); empty if equal.
  """
  import jax
  import numpy as np

  pairs, problems = _flat_pairs(got, want)
  for where, g, w in pairs:
    if isinstance(w, jax.Array):
      problems += _array_differences(where, g, w)
    elif isinstance(w, np.ndarray):
      if not isinstance(g, np.ndarray):
        problems.append(f"{where}: a {type(g).__name__}, not a numpy array")
      elif g.dtype != w.dtype or g.shape != w.shape:
        problems.append(f"{where}: {g.dtype}{g.shape} != {w.dtype}{w.shape}")
      else:
        problems += _bits_differ(where, g, w)
    elif type(g) is not type(w):
      problems.append(f"{where}: type {type(g).__name__} != {type(w).__name__}")
    elif not g == w:
      problems.append(f"{where}: {g!r} != {w!r}")
  return problems


def host_differences(got: Any, want: Any, *, jax_arrays: bool = False) -> list[str]:
  """What differs between two pytrees read as numpy arrays (e.g. after a restore to host).

  Shardings and leaf types are ignored (unless `jax_arrays`): each leaf of both trees is
  taken as a numpy array (a PRNG key array's dtype is compared, then its key data) and
  dtype, shape and bytes must be equal. Every value must be addressable here.

  Args:
    got: the tree to check.
    want: the expected tree.
    jax_arrays: every leaf of `got` must also be a jax.Array.

  Returns:
    One readable line per difference; empty if equal.
  """
  import jax
  import numpy as np

  def dtype_of(x):
    return x.dtype if isinstance(x, jax.Array) else np.asarray(x).dtype

  pairs, problems = _flat_pairs(got, want)
  for where, g, w in pairs:
    if jax_arrays and not isinstance(g, jax.Array):
      problems.append(f"{where}: a {type(g).__name__}, not a jax.Array")
    elif dtype_of(g) != dtype_of(w) or np.shape(g) != np.shape(w):
      problems.append(f"{where}: {dtype_of(g)}{np.shape(g)} != {dtype_of(w)}{np.shape(w)}")
    else:
      problems += _bits_differ(where, g, w)
  return problems


def _raise_if(problems: list[str]) -> None:
  if problems:
    raise AssertionError("trees differ:\n  " + "\n  ".join(problems))


def assert_trees_equal(got: Any, want: Any) -> None:
  """Asserts `tree_differences(got, want)` is empty.

  Args:
    got: the tree to check.
    want: the expected tree.

  Raises:
    AssertionError: listing every difference.
  """
  _raise_if(tree_differences(got, want))


def assert_host_equal(got: Any, want: Any) -> None:
  """Asserts `host_differences(got, want)` is empty.

  Args:
    got: the tree to check.
    want: the expected tree.

  Raises:
    AssertionError: listing every difference.
  """
  _raise_if(host_differences(got, want))
