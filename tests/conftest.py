"""Shared fixtures: a 4-device CPU platform in one process, scratch folders on the RAM disk,
and a sharded mixed-dtype state on a 2x2 ("data", "model") mesh."""

from __future__ import annotations

import os

# Before anything imports jax: four CPU devices in this one process.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import shutil  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


@pytest.fixture
def shm_dir(tmp_path):
  """A fresh folder on the RAM disk (tmp_path where there is none), removed at teardown."""
  if SHM_ROOT is None:
    yield tmp_path
    return
  path = SHM_ROOT / f"orbax-mtc-test-{uuid.uuid4().hex[:12]}"
  path.mkdir()
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_root(request):
  """A unique RAM-disk path for one multi-process test's node folders, removed even on
  failure (the launcher creates it)."""
  from mp_helpers import new_root

  root = new_root(request.node.name)
  yield root
  shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mesh():
  import jax

  if len(jax.devices()) < 4:
    pytest.skip("needs 4 CPU devices (XLA_FLAGS was set before jax was imported elsewhere)")
  return jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])


def make_state(mesh, seed: int = 0, scale: int = 1) -> dict[str, Any]:
  """A mixed-dtype pytree sharded along both mesh axes; every value depends on `seed`.

  `scale` multiplies the leading dimension of the big leaf (w), to make larger states.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(seed)

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  return {
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


def abstract_of(state: Any) -> Any:
  """jax.ShapeDtypeStruct (with sharding) for jax arrays; other leaves are kept as they are."""
  import jax

  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state)


def assert_trees_equal(got: Any, want: Any) -> None:
  """Bit-for-bit equality, same dtypes, same leaf types, same shardings for jax arrays."""
  import jax
  import numpy as np

  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  assert got_def == want_def, f"tree structure differs: {got_def} vs {want_def}"
  for (path, g), (_, w) in zip(got_flat, want_flat, strict=True):
    where = jax.tree_util.keystr(path)
    if isinstance(w, jax.Array):
      assert isinstance(g, jax.Array), f"{where}: {type(g)} is not a jax.Array"
      assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
      assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
      assert g.sharding == w.sharding, f"{where}: sharding {g.sharding} != {w.sharding}"
      for gs, ws in zip(sorted(g.addressable_shards, key=lambda s: s.device.id),
                        sorted(w.addressable_shards, key=lambda s: s.device.id), strict=True):
        assert gs.device == ws.device and gs.index == ws.index, where
        assert np.asarray(gs.data).tobytes() == np.asarray(ws.data).tobytes(), \
            f"{where}: shard on {gs.device} differs"
      assert np.array_equal(np.asarray(g), np.asarray(w)), f"{where}: values differ"
    elif isinstance(w, np.ndarray):
      assert isinstance(g, np.ndarray), f"{where}: {type(g)} is not a numpy array"
      assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
      assert np.array_equal(g, w) and g.tobytes() == w.tobytes(), f"{where}: values differ"
    else:
      assert type(g) is type(w), f"{where}: type {type(g)} != {type(w)}"
      assert g == w, f"{where}: {g!r} != {w!r}"


def assert_host_equal(got: Any, want: Any) -> None:
  """Bit-for-bit equality of values read back as numpy (e.g. by a plain Orbax restore)."""
  import jax
  import numpy as np

  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  assert got_def == want_def, f"tree structure differs: {got_def} vs {want_def}"
  for (path, g), (_, w) in zip(got_flat, want_flat, strict=True):
    where = jax.tree_util.keystr(path)
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
    assert g.shape == w.shape and g.tobytes() == w.tobytes(), f"{where}: values differ"


def flip_byte(path, offset: int, mask: int = 0xFF) -> None:
  """Corrupts one byte of a file in place (XOR with `mask`)."""
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ mask]))


@pytest.fixture
def saved(shm_dir, mesh):
  """Steps 0..6 saved: local holds 4 and 6, persistent holds 0 and 4."""
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import local_tier

  local, persistent = shm_dir / "local", shm_dir / "persistent"
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=4))
  with mtc.CheckpointManager(local, persistent, mesh, abstract_of(make_state(mesh)),
                             options=options) as mgr:
    for step in range(7):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh, step))))
  assert local_tier.committed_steps(local) == [4, 6]
  return local, persistent


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """A GCS JSON-API server on loopback (tests/gcs_server.py), killed after the module."""
  from gcs_server import GcsServer

  server = GcsServer(tmp_path_factory.mktemp("gcs-data"))
  server.start()
  try:
    yield server
  finally:
    server.kill()
