"""`LocalCheckpointOptions.device_copy`: on accelerators a save copies the shards on the device
and the writer thread moves the copy to host memory, so `save()` does not wait for the
transfer. CPU shards are read in place; `staging.COPY_ON_CPU` makes CPU devices take the
accelerator path here, so the path is tested without an accelerator (the GPU figures are in
docs/benchmarks.md); `staging.PIN_ON_CPU` likewise makes them stage through pinned host
memory, as GPUs do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_mtc as mtc
from orbax_mtc import arrays
from orbax_mtc.local import staging


def _state(mesh, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {"w": jax.device_put(jnp.asarray(rng.standard_normal((8, 6), np.float32)),
                              NamedSharding(mesh, P("data", "model"))),
          "b": jax.device_put(jnp.asarray(rng.integers(0, 99, (4,), np.int32)),
                              NamedSharding(mesh, P())),
          "step": np.int64(seed)}


@pytest.fixture
def copy_on_cpu(monkeypatch):
  monkeypatch.setattr(staging, "COPY_ON_CPU", True)


@pytest.fixture(params=["device", "pinned"])
def staged_via(request, monkeypatch, copy_on_cpu):
  """Both accelerator paths: a device-side copy, and a transfer into pinned host memory."""
  monkeypatch.setattr(staging, "PIN_ON_CPU", request.param == "pinned")
  return request.param


def test_stage_leaves_device_copies_for_the_writer(mesh, staged_via):
  state = _state(mesh, 1)
  expected = {k: np.asarray(v) for k, v in state.items()}
  staged = staging.stage(3, {"state": state}, {}, default_item=False, device_copy=True)
  on_device = [p for _, p in staged.pieces if not isinstance(p, np.ndarray)]
  # One copy per distinct shard of the two arrays (w: 4 shards, b: 1 replicated), none of
  # the host value.
  assert len(on_device) == 5
  assert all(p.pinned == (staged_via == "pinned") for p in on_device)
  if staged_via == "pinned":
    assert {p.source.sharding.memory_kind for p in on_device} == {"pinned_host"}
  for leaf in ("w", "b"):
    state[leaf].delete()  # the caller's arrays may go (a donating step) once stage returns
  staged.to_host()
  assert all(isinstance(p, np.ndarray) for _, p in staged.pieces)
  leaves = {leaf.path: leaf for leaf in staged.items["state"].leaves}
  for path, name in (("['w']", "w"), ("['b']", "b")):
    leaf = leaves[path]
    for shard in leaf.shards:
      got = staged.bytes_at(shard.offset, shard.nbytes).view(expected[name].dtype)
      want = expected[name][tuple(slice(a, b) for a, b in shard.index)]
      assert np.array_equal(got.reshape(want.shape), want)


def test_without_device_copy_nothing_is_left_on_the_device(mesh, copy_on_cpu):
  staged = staging.stage(3, {"state": _state(mesh, 2)}, {}, default_item=False,
                         device_copy=False)
  assert all(isinstance(p, np.ndarray) for _, p in staged.pieces)


def test_a_save_survives_its_arrays_being_deleted_right_after_save(mesh, shm_dir,
                                                                    staged_via):
  states = [_state(mesh, seed) for seed in (10, 11)]
  expected = [{k: np.asarray(v) for k, v in s.items()} for s in states]
  abstract = arrays.abstract_tree(states[0])
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh, abstract,
                             options=options) as mgr:
    for step, state in zip((1, 2), states, strict=True):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
      # As a training step that donates the state would: the originals are gone while the
      # writer may still be moving the step to host memory.
      state["w"].delete()
      state["b"].delete()
    mgr.wait_until_finished()
    for step, want in zip((1, 2), expected, strict=True):
      restored = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract))).state
      assert mgr.last_restore.tier == "local"
      for name, value in want.items():
        assert np.array_equal(np.asarray(restored[name]), value), (step, name)


def test_the_option_is_a_bool():
  assert mtc.LocalCheckpointOptions().device_copy is True
  with pytest.raises(TypeError, match="device_copy"):
    mtc.LocalCheckpointOptions(device_copy="yes")


def test_pinned_copies_are_written_from_their_own_memory(mesh, copy_on_cpu, monkeypatch):
  """The writer reads a pinned copy in place (no second copy into fresh host pages), and the
  bytes it reads stay valid after the caller's arrays and the staged copies' names are gone."""
  monkeypatch.setattr(staging, "PIN_ON_CPU", True)
  state = _state(mesh, 3)
  expected = np.asarray(state["w"])
  staged = staging.stage(4, {"state": state}, {}, default_item=False, device_copy=True)
  copies = {id(p): p.source for _, p in staged.pieces if not isinstance(p, np.ndarray)}
  state["w"].delete()
  staged.to_host()
  leaf = next(leaf for leaf in staged.items["state"].leaves if leaf.path == "['w']")
  for shard in leaf.shards:
    got = staged.bytes_at(shard.offset, shard.nbytes)
    assert not got.flags.writeable
    addresses = {c.unsafe_buffer_pointer() for c in copies.values()}
    assert got.ctypes.data in addresses  # the pinned buffer itself
  copies.clear()  # only the staged views hold the pinned copies now
  for shard in leaf.shards:
    got = staged.bytes_at(shard.offset, shard.nbytes).view(np.float32)
    want = expected[tuple(slice(a, b) for a, b in shard.index)]
    assert np.array_equal(got.reshape(want.shape), want)


def test_a_pinned_copy_that_is_not_plain_bytes_is_copied(mesh, copy_on_cpu, monkeypatch):
  """Where the pinned buffer cannot be read in place (a size that does not match: a padded or
  tiled host layout), the writer copies it as before."""
  monkeypatch.setattr(staging, "PIN_ON_CPU", True)
  pinned = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
                          jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                            memory_kind="pinned_host"))
  assert staging._pinned_view(pinned, pinned.nbytes + 4) is None
  view = staging._pinned_view(pinned, pinned.nbytes)
  assert np.array_equal(view.view(np.float32), np.arange(12, dtype=np.float32))


def test_the_gpu_staging_benchmark_runs_here(tmp_path):
  """benchmarks/gpu_staging.py (run by benchmarks/gpu_suite.sh on a GPU, where a failure costs
  scarce device time) runs on CPU with the pinned path forced: its save-then-donate check
  restores every step bit-exact and its bandwidth table is written."""
  repo = Path(__file__).resolve().parents[1]
  done = subprocess.run(
      [sys.executable, str(repo / "benchmarks" / "gpu_staging.py"), "--mib", "2", "--reps", "1",
       "--check-mib", "1", "--out", str(tmp_path)],
      capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stdout.count("bit-exact") == 7  # six restored steps and the table's line
  result = json.loads((tmp_path / "gpu-staging.json").read_text())
  assert result["check_ok"] is True and [r["mib"] for r in result["rows"]] == [2]


def test_a_cpu_save_lets_go_of_the_arrays_buffers_before_it_writes(mesh):
  """On CPU a save stages views of the arrays' own buffers (no copy in `save()`); the writer
  copies them into a reused host buffer before writing and lets go of them, so a training step
  that donates the state reuses its buffers (JAX does not donate a buffer a view holds)."""
  donate = jax.jit(lambda a: a * 2, donate_argnums=0)
  x = jax.device_put(jnp.arange(4096, dtype=jnp.float32))
  want = np.asarray(x).copy()
  staged = staging.stage(1, {"state": {"x": x}}, {}, default_item=False, device_copy=True)
  assert staged.borrowed == frozenset({0})
  pool = staging.HostPool()
  buffer = pool.get(staged.size)
  staged.release(buffer)
  assert not staged.borrowed and pool.get(staged.size) is buffer  # reused, not reallocated
  donate(x)
  assert x.is_deleted()  # the step got the buffer
  assert np.array_equal(staged.bytes_at(0, want.nbytes).view(np.float32), want)
  kept = jax.device_put(jnp.arange(4096, dtype=jnp.float32))
  held = staging.stage(1, {"state": {"x": kept}}, {}, default_item=False, device_copy=False)
  assert not held.borrowed  # without device_copy the writer writes from the views
  donate(kept)
  assert not kept.is_deleted()


def test_saving_every_step_before_a_donating_update_keeps_every_step_bit_exact(mesh, shm_dir):
  """The loop the every-step bench runs: update (donating the state), save; each saved step
  restored bit-exact (int32: numpy replays the update exactly)."""
  update = jax.jit(lambda s: {"w": s["w"] * 3 + 1}, donate_argnums=0)
  state = {"w": jax.device_put(jnp.arange(50_000, dtype=jnp.int32))}
  host = {"w": np.arange(50_000, dtype=np.int32)}
  abstract = arrays.abstract_tree(state)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=5),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
  expected = {}
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh, abstract,
                             options=options) as mgr:
    for step in range(1, 6):
      state = update(state)
      host = {"w": host["w"] * 3 + 1}
      expected[step] = host["w"]
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=True)
    mgr.wait_until_finished()
    for step, want in expected.items():
      got = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract))).state
      assert mgr.last_restore.tier == "local"
      assert np.array_equal(np.asarray(got["w"]), want), step
