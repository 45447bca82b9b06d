"""Shared fixtures: a 4-device CPU platform in one process, scratch folders on the RAM disk,
and a sharded mixed-dtype state on a 2x2 ("data", "model") mesh (from `orbax_mtc.testing`)."""

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

# Fixtures shared by the modules a long test file was split into.
pytest_plugins = ["cli_support", "configs_support", "manager_support", "manifest_support",
                  "maxtext_patch_support", "maxtext_real_support", "orbax_parity_support"]

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


# The state and comparison helpers are orbax_mtc.testing's, under the names the tests import
# from here; imported when first called, so that collecting a test that needs no JAX stays cheap.


def make_state(mesh, seed: int = 0, scale: int = 1) -> dict[str, Any]:
  """`orbax_mtc.testing.example_state`: a mixed-dtype pytree on `mesh`, values from `seed`;
  `scale` multiplies the leading dimension of the big leaf (params/w)."""
  from orbax_mtc import testing

  return testing.example_state(mesh, seed, scale=scale)


def abstract_of(state: Any) -> Any:
  """`orbax_mtc.testing.abstract_of`: jax.ShapeDtypeStruct (with sharding) for jax arrays."""
  from orbax_mtc import testing

  return testing.abstract_of(state)


def assert_trees_equal(got: Any, want: Any) -> None:
  """`orbax_mtc.testing.assert_trees_equal`: bit for bit, same dtypes, leaf types, shardings."""
  from orbax_mtc import testing

  testing.assert_trees_equal(got, want)


def assert_host_equal(got: Any, want: Any) -> None:
  """`orbax_mtc.testing.assert_host_equal`: bit for bit, values read back as numpy."""
  from orbax_mtc import testing

  testing.assert_host_equal(got, want)


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
  from orbax_mtc.local.store import committed_steps

  local, persistent = shm_dir / "local", shm_dir / "persistent"
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=4))
  with mtc.CheckpointManager(local, persistent, mesh, abstract_of(make_state(mesh)),
                             options=options) as mgr:
    for step in range(7):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(make_state(mesh, step))))
  assert committed_steps(local) == [4, 6]
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
