"""Dtype casts on restore, made as Orbax makes them (no I/O, no collective).

Orbax restores an array leaf whose target asks for another dtype (a `jax.ShapeDtypeStruct`,
`jax.Array` or numpy target, or `ArrayRestoreArgs(dtype=...)`) by casting it on the host
while it reads it, through TensorStore's `cast` driver, before it goes to the devices. The RAM
tier casts each verified host shard with the same driver, so a cast restore gives the same
bits from every tier (NaN payloads included, where numpy's `astype` would differ). A PRNG key
leaf is never cast (Orbax only places keys).
"""

from __future__ import annotations

import functools

import numpy as np
import tensorstore as ts


@functools.lru_cache(maxsize=256)
def castable(saved: np.dtype, target: np.dtype) -> bool:
  """Whether a leaf saved as `saved` can be restored as `target` (TensorStore converts it)."""
  try:
    ts.cast(ts.array(np.zeros((0,), saved)), ts.dtype(np.dtype(target).name))
  except (ValueError, TypeError):
    return False
  return True


def cast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`value` (host bytes of one shard) converted to `dtype`, in a new array."""
  return ts.cast(ts.array(value), ts.dtype(np.dtype(dtype).name)).read().result()
