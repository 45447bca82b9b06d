"""Test states and bit-for-bit tree comparison, for the tests and the benchmark workers.

Like `orbax.checkpoint.test_utils`: nothing in the library imports this module. It holds

  * deterministic states: `example_state` (one process: a mixed-dtype tree on a mesh, with
    host leaves) and `sharded_state` (any number of processes: every value a pure function of
    (leaf, global position, seed, step), so a process that restored step S recomputes its own
    shards of what was saved at S without any other process), with their abstract forms
    (`abstract_of`, `abstract_sharded_state`) and the numpy global form
    (`global_state_numpy`);
  * comparisons of raw bits (`tree_differences`, `host_differences` and their `assert_`
    forms), from `tree_compare` and re-exported here: dtypes, shapes and shardings must match
    and every byte must be equal, so a NaN payload or the sign of -0.0 counts; PRNG key arrays
    are compared through their key data.

JAX and numpy are imported inside the functions, so importing this module costs nothing more
than importing `orbax_mtc`.
"""

from __future__ import annotations

from typing import Any

from orbax_mtc.tree_compare import assert_host_equal as assert_host_equal
from orbax_mtc.tree_compare import assert_trees_equal as assert_trees_equal
from orbax_mtc.tree_compare import host_differences as host_differences
from orbax_mtc.tree_compare import leaf_bits as leaf_bits
from orbax_mtc.tree_compare import tree_differences as tree_differences

# ----------------------------------------------------------------------------- example_state


def example_state(mesh, seed: int = 0, *, scale: int = 1,
                  arrays_only: bool = False) -> dict[str, Any]:
  """A mixed-dtype pytree sharded along both axes of a ("data", "model") mesh.

  float32, bfloat16 and int32 jax.Arrays (sharded on both axes, one axis, and replicated), a
  jax scalar, a Python int and a host numpy array; every value is drawn from a numpy RNG
  seeded with `seed`. Built from global numpy values, so every device of `mesh` must be
  addressable (one process).

  Args:
    mesh: a `jax.sharding.Mesh` with axes "data" and "model".
    seed: the RNG seed; also sets the "scale" and "step" leaves.
    scale: multiplies the leading dimension of the big leaf (params/w), for larger states.
    arrays_only: leave out the leaves that are not jax.Arrays ("step", "host"); the other
      values are the same as with them.

  Returns:
    {"params": {"w", "b"}, "ids", "scale", "step", "host", "layers": [array]}.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(seed)

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  state = {
      "params": {
          "w": put(rng.standard_normal((8 * scale, 6)).astype(np.float32), P("data", "model")),
          "b": put(jnp.asarray(rng.standard_normal(8), dtype=jnp.bfloat16), P("model")),
      },
      "ids": put(rng.integers(-1000, 1000, (4, 4)).astype(np.int32), P()),
      "scale": put(np.float32(seed + 0.5), P()),
      "step": int(seed) * 7 + 1,
      "host": rng.standard_normal(5),
      "layers": [put(rng.standard_normal((4, 2)).astype(np.float32), P(None, "model"))],
  }
  if arrays_only:
    del state["step"], state["host"]
  return state


def abstract_of(tree: Any) -> Any:
  """The restore target of `tree`: `jax.ShapeDtypeStruct` (with sharding) for jax.Arrays.

  Args:
    tree: a pytree of jax.Arrays and other leaves.

  Returns:
    `orbax_mtc.arrays.abstract_tree(tree)`: other leaves are kept as they are, PRNG key arrays
    keep their key dtype.
  """
  from orbax_mtc import arrays

  return arrays.abstract_tree(tree)


# ----------------------------------------------------------------------------- sharded_state

# Leaf path -> (dtype, PartitionSpec axes, shape as a function of (data, model, rows)).
# "data" spans processes (one row of the mesh per process), "model" a process's devices.
_LEAVES: dict[str, tuple[str, tuple, Any]] = {
    "params/w": ("float32", ("data", "model"), lambda d, m, r: (d * r, 64)),
    "params/b": ("bfloat16", ("model",), lambda d, m, r: (16 * m,)),
    "opt/mu": ("float32", (None, "model"), lambda d, m, r: (4 * d, 4 * m)),
    "idx": ("int32", ("data",), lambda d, m, r: (8 * d, 3)),
    "count": ("int32", (), lambda d, m, r: ()),
    "lr": ("float32", (), lambda d, m, r: ()),
}

# With keys=True, typed PRNG key leaves too: path -> (implementation, axes, key array shape).
_KEY_LEAVES: dict[str, tuple[str, tuple, Any]] = {
    "rngs/dropout": ("unsafe_rbg", ("data",), lambda d, m, r: (4 * d,)),
    "rngs/params": ("threefry2x32", (), lambda d, m, r: ()),
}

ARRAY_LEAVES: tuple[str, ...] = tuple(_LEAVES)
"""Paths ("params/w", ...) of the numeric leaves of `sharded_state`."""
KEY_LEAVES: tuple[str, ...] = tuple(_KEY_LEAVES)
"""Paths of the PRNG key leaves `sharded_state(..., keys=True)` adds."""

LAYOUTS = ("mixed", "dp")

_HASH_CACHE: dict[tuple, Any] = {}


def _hash_bits(leaf: str, shape: tuple[int, ...], index: tuple[slice, ...], seed: int):
  """uint64 pseudo-random bits of the global positions `index` of a leaf (step-independent)."""
  import numpy as np

  key = (leaf, shape, tuple((s.start, s.stop) for s in index), seed)
  cached = _HASH_CACHE.get(key)
  if cached is not None:
    return cached
  bounds = [sl.indices(dim)[:2] for sl, dim in zip(index, shape, strict=True)]
  strides = [int(np.prod(shape[k + 1:])) for k in range(len(shape))]
  lin = np.zeros([b - a for a, b in bounds], dtype=np.uint64)
  for k, ((a, b), stride) in enumerate(zip(bounds, strides, strict=True)):
    axis = np.arange(a, b, dtype=np.uint64) * np.uint64(stride)
    lin = lin + axis.reshape([-1 if j == k else 1 for j in range(len(shape))])
  leaf_id = sum(ord(c) * 131 ** i for i, c in enumerate(leaf)) % (1 << 31)
  x = lin + np.uint64((seed * 1_000_003 + leaf_id) % (1 << 62))
  # splitmix64
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  _HASH_CACHE[key] = x
  return x


def leaf_values(leaf: str, shape: tuple[int, ...], index: tuple[slice, ...], seed: int,
                step: int):
  """The values of some global positions of one numeric leaf of `sharded_state`.

  Args:
    leaf: a path of `ARRAY_LEAVES`.
    shape: the leaf's global shape.
    index: one slice per dimension: the positions wanted.
    seed: the state's seed.
    step: the step; every value changes with it, exactly (no rounding).

  Returns:
    A numpy array of the leaf's dtype, shaped as `index` selects.
  """
  import ml_dtypes
  import numpy as np

  dtype = _LEAVES[leaf][0]
  if leaf == "count":
    return np.asarray(step, dtype=np.int32)
  if leaf == "lr":
    return np.asarray(1.0 / (step + 3), dtype=np.float32)
  h = _hash_bits(leaf, shape, index, seed)
  if dtype == "float32":
    # 24 random bits in [-4, 4), shifted by the step: exact, and different at every step.
    base = (h >> np.uint64(40)).astype(np.float64) * 2.0 ** -21 - 4.0
    return (base + step).astype(np.float32)
  if dtype == "bfloat16":
    k = ((h >> np.uint64(56)).astype(np.int64) + step) % 256 - 128
    return (k / 16.0).astype(ml_dtypes.bfloat16)  # k/16 with |k| <= 128 is exact in bf16
  if dtype == "int32":
    return ((h >> np.uint64(33)).astype(np.int64) - (1 << 30) + 7 * step).astype(np.int32)
  raise AssertionError(dtype)


def global_state_numpy(seed: int, step: int, data: int, model: int, rows: int) -> dict:
  """The whole `sharded_state` (without key leaves) as nested dicts of numpy arrays.

  What any topology restores, e.g. a plain Orbax restore to host memory.

  Args:
    seed: the state's seed.
    step: the step.
    data: the size of the mesh's "data" axis when the state was built.
    model: the size of its "model" axis.
    rows: rows of params/w per "data" index.

  Returns:
    {"params": {"w", "b"}, "opt": {"mu"}, "idx", "count", "lr"} of numpy arrays.
  """
  out: dict[str, Any] = {}
  for leaf, (_, _, shape_fn) in _LEAVES.items():
    shape = shape_fn(data, model, rows)
    _set(out, leaf, leaf_values(leaf, shape, tuple(slice(0, d) for d in shape), seed, step))
  return out


def _set(tree: dict, path: str, value: Any) -> None:
  *parents, last = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[last] = value


def _get(tree: Any, path: str) -> Any:
  for p in path.split("/"):
    tree = tree[p]
  return tree


def process_mesh(replicas: int | None = None):
  """A ("data", "model") mesh over every device of the job, one row per process by default.

  Args:
    replicas: the size of the "data" axis; default `jax.process_count()`.

  Returns:
    A `jax.sharding.Mesh` of the devices sorted by (process index, id), `replicas` rows.
  """
  import jax
  import numpy as np

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(replicas or jax.process_count(), -1)
  return jax.sharding.Mesh(grid, ("data", "model"))


def abstract_sharded_state(mesh, rows: int, *, layout: str = "mixed",
                           keys: bool = False, shape_axes: tuple[int, int] | None = None) -> dict:
  """The abstract form of `sharded_state` (the same as `abstract_of` of it), without values.

  Args:
    mesh: a mesh with axes "data" and "model".
    rows: rows of params/w per "data" index.
    layout: "mixed" (leaves sharded along "data", "model", both or neither) or "dp" (every
      leaf replicated across "data": pure data parallelism).
    keys: add the PRNG key leaves `KEY_LEAVES`.
    shape_axes: (data, model) sizes the shapes follow instead of the mesh's own: the same
      state on another mesh (an elastic restore's target).

  Returns:
    Nested dicts of `jax.ShapeDtypeStruct` with `NamedSharding`s on `mesh`.
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
  data, model = shape_axes or (mesh.shape["data"], mesh.shape["model"])
  out: dict[str, Any] = {}
  for leaf, (dtype, axes, shape_fn) in _LEAVES.items():
    if layout == "dp":
      axes = tuple(None if a == "data" else a for a in axes)
    sharding = NamedSharding(mesh, PartitionSpec(*axes))
    _set(out, leaf, jax.ShapeDtypeStruct(shape_fn(data, model, rows), dtype, sharding=sharding))
  if keys:
    for leaf, (impl, axes, shape_fn) in _KEY_LEAVES.items():
      dtype = jax.eval_shape(lambda impl=impl: jax.random.key(0, impl=impl)).dtype
      sharding = NamedSharding(mesh, PartitionSpec(*axes))
      _set(out, leaf, jax.ShapeDtypeStruct(shape_fn(data, model, rows), dtype,
                                           sharding=sharding))
  return out


def _key_array(leaf: str, spec, seed: int, step: int):
  """A PRNG key leaf at `step`: key data a pure function of (leaf, position, seed, step), each
  device's shard wrapped on that device."""
  import jax
  import numpy as np

  impl = _KEY_LEAVES[leaf][0]
  dims = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), spec.dtype)).shape
  shape = tuple(spec.shape) + tuple(dims)
  shards = []
  for device, index in spec.sharding.addressable_devices_indices_map(spec.shape).items():
    index = tuple(index) + (slice(None),) * len(dims)
    data = ((_hash_bits(leaf, shape, index, seed) >> np.uint64(32)) + np.uint64(step)).astype(
        np.uint32)
    shards.append(jax.random.wrap_key_data(jax.device_put(data, device), impl=impl))
  return jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, shards)


def sharded_state(mesh, rows: int, seed: int, step: int, *, layout: str = "mixed",
                  keys: bool = False, shape_axes: tuple[int, int] | None = None) -> dict:
  """The state at `step`, each process building only its own shards.

  Every value is a pure function of (leaf, global position, seed, step) and the shapes depend
  on the mesh's axis sizes only, so any process of any job recomputes what was saved.

  Args:
    mesh: a mesh with axes "data" and "model" (see `process_mesh`).
    rows: rows of params/w per "data" index.
    seed: the state's seed.
    step: the step.
    layout: "mixed" or "dp", as in `abstract_sharded_state`.
    keys: add the PRNG key leaves `KEY_LEAVES`.
    shape_axes: as in `abstract_sharded_state`.

  Returns:
    Nested dicts of jax.Arrays, shaped and sharded as `abstract_sharded_state`.
  """
  import jax

  out: dict[str, Any] = {}
  abstract = abstract_sharded_state(mesh, rows, layout=layout, keys=keys, shape_axes=shape_axes)
  for leaf in _LEAVES:
    spec = _get(abstract, leaf)
    array = jax.make_array_from_callback(
        spec.shape, spec.sharding,
        lambda index, leaf=leaf, shape=spec.shape: leaf_values(leaf, shape, index, seed, step))
    _set(out, leaf, array)
  if keys:
    for leaf in _KEY_LEAVES:
      _set(out, leaf, _key_array(leaf, _get(abstract, leaf), seed, step))
  return out
