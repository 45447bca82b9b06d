"""Typed PRNG key leaves (jax.random.key(..., impl=...), dtype key<fry>/key<urbg>) in every tier.

The RAM tier stores a key leaf as its key data (uint32, key shape + the implementation's key
shape) with the implementation in the manifest; a restore rebuilds keys of that
implementation on the target sharding. The persistent tier is Orbax's, which does the same.
Every check compares `jax.random.key_data` bit for bit, and the restored dtype and sharding.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, assert_trees_equal, make_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp_helpers import assert_ok, mp_events, run_job, tail

import orbax_mtc as mtc
from orbax_mtc.local.format import (
  DATA,
  MANIFEST_CRC_KEY,
  AbstractStateMismatchError,
  CorruptStepError,
  ManifestError,
  StepManifest,
)
from orbax_mtc.local.read import SavedLeaf, read_step
from orbax_mtc.local.specs import describe_sharding, item_metadata
from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier, read_manifest
from orbax_mtc.peers import shards

pytestmark = pytest.mark.timeout(240)


def _is_key(x) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def key_state(mesh, seed: int = 0) -> dict:
  """make_state plus PRNG keys: sharded unsafe_rbg keys, a replicated threefry key and a 2-D
  threefry key array sharded over both mesh axes."""
  state = make_state(mesh, seed)
  dropout = jax.random.split(jax.random.key(seed, impl="unsafe_rbg"), 8)
  grid = jax.random.split(jax.random.key(seed + 1, impl="threefry2x32"), 8).reshape(4, 2)
  state["rngs"] = {
      "dropout": jax.device_put(dropout, NamedSharding(mesh, P("data"))),
      "params": jax.device_put(jax.random.key(seed + 2), NamedSharding(mesh, P())),
      "grid": jax.device_put(grid, NamedSharding(mesh, P("data", "model"))),
  }
  return state


def assert_keys_equal(got, want, where: str = "") -> None:
  """Same key dtype, shape and sharding; the same key data, shard for shard."""
  assert isinstance(got, jax.Array) and _is_key(got), f"{where}: {type(got)} {got!r}"
  assert got.dtype == want.dtype and str(got.dtype) == str(want.dtype), where
  assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want)), where
  assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
  assert got.sharding == want.sharding, f"{where}: {got.sharding} != {want.sharding}"
  got_data, want_data = jax.random.key_data(got), jax.random.key_data(want)
  for g, w in zip(sorted(got_data.addressable_shards, key=lambda s: s.device.id),
                  sorted(want_data.addressable_shards, key=lambda s: s.device.id), strict=True):
    assert g.device == w.device and g.index == w.index, where
    assert np.asarray(g.data).tobytes() == np.asarray(w.data).tobytes(), \
        f"{where}: key data on {g.device} differs"
  assert np.array_equal(np.asarray(got_data), np.asarray(want_data)), where


def assert_state_equal(got, want) -> None:
  """Key leaves as keys, every other leaf with conftest's bit-for-bit comparison."""
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  assert got_def == want_def
  keys = 0
  for (path, g), (_, w) in zip(got_flat, want_flat, strict=True):
    if _is_key(w):
      assert_keys_equal(g, w, jax.tree_util.keystr(path))
      keys += 1
  assert keys, "the state holds no key leaves"

  def no_keys(tree):
    return jax.tree.map(lambda x: 0 if _is_key(x) else x, tree)

  assert_trees_equal(no_keys(got), no_keys(want))


# ----------------------------------------------------------------------------- RAM tier alone


@pytest.fixture
def tier(shm_dir):
  tier = LocalTier(shm_dir / "local", max_to_keep=2)
  tier.prepare()
  yield tier
  tier.close()


def _write(tier, state, step=1):
  staged = stage(step, {"state": state}, {}, default_item=False)
  step_dir = tier.write(staged, process_index=0, process_count=1)
  return step_dir, read_manifest(step_dir)


def test_local_tier_round_trip_of_key_leaves(tier, mesh):
  state = key_state(mesh, seed=3)
  step_dir, manifest = _write(tier, state)
  records = {leaf.path: leaf for leaf in manifest.items["state"].leaves}
  dropout = records["['rngs']['dropout']"]
  assert (dropout.key_impl, dropout.dtype, dropout.shape) == ("unsafe_rbg", "uint32", (8, 4))
  assert dropout.sharding == describe_sharding(state["rngs"]["dropout"].sharding)
  # Sharded over "data" (2 rows of devices): two distinct shards, each with the whole key dim.
  assert sorted(s.index for s in dropout.shards) == [((0, 4), (0, 4)), ((4, 8), (0, 4))]
  params, grid = records["['rngs']['params']"], records["['rngs']['grid']"]
  assert (params.key_impl, params.shape) == ("threefry2x32", (2,))
  assert (grid.key_impl, grid.shape, len(grid.shards)) == ("threefry2x32", (4, 2, 2), 4)
  assert records["['params']['w']"].key_impl is None
  assert '"key_impl"' not in json.dumps(
      json.loads(manifest.to_json())["items"]["state"]["leaves"][0])  # only where set

  restored = read_step(step_dir, manifest, {"state": abstract_of(state)})["state"]
  assert_state_equal(restored, state)
  # Live key arrays as targets work too.
  assert_state_equal(read_step(step_dir, manifest, {"state": state})["state"], state)


def test_local_tier_key_leaves_without_a_target_shape(tier, mesh):
  """SavedLeaf targets (only a sharding) and item_metadata give keys back as keys."""
  state = key_state(mesh, seed=4)
  step_dir, manifest = _write(tier, state)
  targets = jax.tree.map(lambda x: SavedLeaf(x.sharding) if isinstance(x, jax.Array) else x,
                         state)
  assert_state_equal(read_step(step_dir, manifest, {"state": targets})["state"], state)

  meta = item_metadata(manifest)["state"]["rngs"]
  for name in ("dropout", "params", "grid"):
    want = state["rngs"][name]
    assert meta[name].shape == want.shape and meta[name].dtype == want.dtype, name


def test_local_tier_host_key_target_rebuilds_replicated_keys(tier, mesh):
  """A key target with no sharding (a host value) gets the keys on the default device."""
  state = key_state(mesh, seed=5)
  step_dir, manifest = _write(tier, state)
  target = abstract_of(state)
  key = state["rngs"]["params"]
  target["rngs"]["params"] = jax.ShapeDtypeStruct(key.shape, key.dtype)
  got = read_step(step_dir, manifest, {"state": target})["state"]["rngs"]["params"]
  assert got.dtype == key.dtype and got.devices() == {jax.devices()[0]}
  assert np.asarray(jax.random.key_data(got)).tobytes() == \
      np.asarray(jax.random.key_data(key)).tobytes()
  # A sharded key leaf is not whole on any one device: refused, naming the leaf.
  dropout = state["rngs"]["dropout"]
  target["rngs"]["dropout"] = jax.ShapeDtypeStruct(dropout.shape, dropout.dtype)
  with pytest.raises(AbstractStateMismatchError, match=r"\['dropout'\].*no sharding"):
    read_step(step_dir, manifest, {"state": target})


def _with_leaf(state_abstract, path, leaf):
  out = jax.tree.map(lambda x: x, state_abstract)
  out["rngs"][path] = leaf
  return out


@pytest.mark.parametrize("case", ["other_impl", "plain_target", "key_target_for_plain_leaf",
                                  "key_data_target", "other_shape"])
def test_mismatched_key_targets_are_abstract_state_errors(tier, mesh, case):
  state = key_state(mesh, seed=6)
  step_dir, manifest = _write(tier, state)
  abstract = abstract_of(state)
  dropout = state["rngs"]["dropout"]
  fry = jax.random.key(0, impl="threefry2x32").dtype
  if case == "other_impl":  # saved unsafe_rbg, asked for threefry
    target = _with_leaf(abstract, "dropout", jax.ShapeDtypeStruct(dropout.shape, fry,
                                                                  sharding=dropout.sharding))
    pattern = r"\['dropout'\].*key<urbg>.*'unsafe_rbg'.*asks for shape \(8,\) dtype key<fry>"
  elif case == "plain_target":
    target = _with_leaf(abstract, "dropout", jax.ShapeDtypeStruct(
        dropout.shape, np.float32, sharding=dropout.sharding))
    pattern = r"\['dropout'\].*key<urbg>.*asks for shape \(8,\) dtype float32"
  elif case == "key_target_for_plain_leaf":
    target = abstract_of(state)
    w = state["params"]["w"]
    target["params"]["w"] = jax.ShapeDtypeStruct(w.shape, fry, sharding=w.sharding)
    pattern = r"\['w'\].*dtype float32, but.*asks for shape \(8, 6\) dtype key<fry>"
  elif case == "key_data_target":  # the stored data's own spec is not the leaf's
    target = _with_leaf(abstract, "dropout", jax.ShapeDtypeStruct(
        (8, 4), np.uint32, sharding=NamedSharding(mesh, P("data", None))))
    pattern = r"\['dropout'\].*shape \(8,\) dtype key<urbg>.*asks for shape \(8, 4\) dtype uint32"
  else:
    target = _with_leaf(abstract, "dropout", jax.ShapeDtypeStruct(
        (4,), dropout.dtype, sharding=dropout.sharding))
    pattern = r"\['dropout'\].*shape \(8,\).*asks for shape \(4,\) dtype key<urbg>"
  with pytest.raises(AbstractStateMismatchError, match=pattern):
    read_step(step_dir, manifest, {"state": target})


def test_key_target_with_another_sharding(tier, mesh):
  """Another sharding whose shards this node saved is served (as for other leaves); one that
  needs shards it did not save is a mismatch naming both shardings."""
  state = key_state(mesh, seed=7)
  step_dir, manifest = _write(tier, state)
  dropout = state["rngs"]["dropout"]
  by_model = NamedSharding(mesh, P("model"))  # the same two halves, on other devices
  target = _with_leaf(abstract_of(state), "dropout", jax.ShapeDtypeStruct(
      dropout.shape, dropout.dtype, sharding=by_model))
  got = read_step(step_dir, manifest, {"state": target})["state"]["rngs"]["dropout"]
  assert_keys_equal(got, jax.device_put(dropout, by_model), "dropout")
  quarters = NamedSharding(mesh, P(("data", "model")))
  target["rngs"]["dropout"] = jax.ShapeDtypeStruct(dropout.shape, dropout.dtype,
                                                   sharding=quarters)
  with pytest.raises(AbstractStateMismatchError,
                     match=r"\['dropout'\]: the target sharding differs.*spec=P\('data',\)"):
    read_step(step_dir, manifest, {"state": target})


def test_corrupt_key_data_is_caught_by_its_checksum(tier, mesh):
  state = key_state(mesh, seed=8)
  step_dir, manifest = _write(tier, state)
  record = next(leaf for leaf in manifest.items["state"].leaves if leaf.key_impl)
  with open(step_dir / DATA, "r+b") as f:
    f.seek(record.shards[0].offset)
    byte = f.read(1)
    f.seek(record.shards[0].offset)
    f.write(bytes([byte[0] ^ 0x01]))
  with pytest.raises(CorruptStepError, match="checksum mismatch"):
    read_step(step_dir, manifest, {"state": abstract_of(state)})


def test_shard_sets_name_key_shards_as_the_manifest_does(tier, mesh):
  """Replication decides which shards a peer already holds by (item, path, index): for keys
  the index spans the key data's dims, as in the manifest, so twins skip identical key
  shards."""
  state = key_state(mesh, seed=13)
  _, manifest = _write(tier, state)
  held = shards.shard_sets({"state": abstract_of(state)}, 1)[0]
  saved = {("state", leaf.path, shard.index) for leaf in manifest.items["state"].leaves
           if leaf.kind == "array" for shard in leaf.shards}
  assert saved == held
  assert ("state", "['rngs']['dropout']", ((0, 4), (0, 4))) in held
  assert len(shards.skip_ordinals(manifest, held)) == len(saved)


# ----------------------------------------------------------------------------- manifest


def _sign(fields: dict) -> str:
  fields = {k: v for k, v in fields.items() if k != MANIFEST_CRC_KEY}
  text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
  return json.dumps({**fields, MANIFEST_CRC_KEY: google_crc32c.value(text.encode())})


@pytest.mark.parametrize("value", [None, 7, "", "bad impl", "rbg;rm", "x" * 65, ["rbg"],
                                   "threefry2x32\n"])
def test_invalid_key_impl_is_a_manifest_error(tier, mesh, value):
  state = key_state(mesh, seed=9)
  _, manifest = _write(tier, state)
  raw = json.loads(manifest.to_json())
  leaf = next(x for x in raw["items"]["state"]["leaves"] if "key_impl" in x)
  leaf["key_impl"] = value
  with pytest.raises(ManifestError, match="'key_impl'"):
    StepManifest.from_json(_sign(raw))


def test_key_impl_on_a_host_leaf_is_a_manifest_error(tier, mesh):
  _, manifest = _write(tier, key_state(mesh, seed=10))
  raw = json.loads(manifest.to_json())
  host = next(x for x in raw["items"]["state"]["leaves"] if x["kind"] == "host")
  host["key_impl"] = "threefry2x32"
  with pytest.raises(ManifestError, match="'key_impl'"):
    StepManifest.from_json(_sign(raw))


def test_manifest_with_key_impl_round_trips_and_unknown_impls_are_refused(tier, mesh):
  state = key_state(mesh, seed=11)
  step_dir, manifest = _write(tier, state)
  assert StepManifest.from_json(manifest.to_json()) == manifest
  # A well-formed name this JAX does not know: the manifest reads, a restore and the metadata
  # say what is missing.
  raw = json.loads(manifest.to_json())
  leaf = next(x for x in raw["items"]["state"]["leaves"] if x.get("key_impl") == "unsafe_rbg")
  leaf["key_impl"] = "future_prng"
  unknown = StepManifest.from_json(_sign(raw))
  with pytest.raises(AbstractStateMismatchError, match="'future_prng' is unknown"):
    read_step(step_dir, unknown, {"state": abstract_of(state)})
  with pytest.raises(ManifestError, match="'future_prng' is unknown"):
    item_metadata(unknown)
  # A known implementation whose key shape the stored data does not have (rbg keys are 4
  # words, threefry keys 2): refused too.
  leaf["key_impl"] = "threefry2x32"
  wrong = StepManifest.from_json(_sign(raw))
  with pytest.raises(AbstractStateMismatchError, match="is not 'threefry2x32' key data"):
    read_step(step_dir, wrong, {"state": abstract_of(state)})


# ----------------------------------------------------------------------------- the manager


def _options(**kwargs):
  return mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=4),
      replication=mtc.ReplicationOptions(replica_axis="data"), **kwargs)


@pytest.fixture
def dirs(shm_dir):
  return shm_dir / "local", shm_dir / "persistent"


@pytest.fixture
def open_manager(dirs, mesh):
  managers = []

  def make(abstract=None):
    mgr = mtc.CheckpointManager(dirs[0], dirs[1], mesh,
                                abstract if abstract is not None
                                else abstract_of(key_state(mesh)), options=_options())
    managers.append(mgr)
    return mgr

  yield make
  for mgr in managers:
    with contextlib.suppress(Exception):
      mgr.close()


def _save_range(mgr, mesh, steps):
  states = {}
  for step in steps:
    states[step] = key_state(mesh, step)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states[step])))
  mgr.wait_until_finished()
  return states


def test_manager_restores_keys_from_ram(open_manager, mesh):
  mgr = open_manager()
  states = _save_range(mgr, mesh, range(0, 7))
  restored = mgr.restore(None)
  assert mgr.last_restore.tier == "local" and mgr.last_restore.step == 6
  assert_state_equal(restored.state, states[6])
  explicit = mgr.restore(6, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_of(states[6]))))
  assert mgr.last_restore.tier == "local"
  assert_state_equal(explicit.state, states[6])
  meta = mgr.item_metadata(6).state["rngs"]  # RAM only: from the manifest
  assert meta["dropout"].dtype == states[6]["rngs"]["dropout"].dtype
  assert meta["dropout"].shape == (8,) and meta["grid"].shape == (4, 2)


def test_manager_restores_keys_from_the_persistent_tier(open_manager, dirs, mesh):
  mgr = open_manager()
  states = _save_range(mgr, mesh, range(0, 7))
  mgr.close()
  shutil.rmtree(dirs[0])  # only the persistent tier (steps 0, 4) is left
  again = open_manager()
  assert again.all_steps() == [0, 4]
  restored = again.restore(None)
  assert again.last_restore.tier == "persistent" and again.last_restore.step == 4
  assert_state_equal(restored.state, states[4])
  explicit = again.restore(4, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract_of(states[4]))))
  assert_state_equal(explicit.state, states[4])

  # The wrong implementation is refused naming the leaf, before Orbax reads anything.
  wrong = abstract_of(states[4])
  dropout = wrong["rngs"]["dropout"]
  wrong["rngs"]["dropout"] = jax.ShapeDtypeStruct(
      dropout.shape, jax.random.key(0, impl="threefry2x32").dtype, sharding=dropout.sharding)
  with pytest.raises(AbstractStateMismatchError, match=r"\['dropout'\].*key<fry>"):
    again.restore(4, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=wrong)))


def test_persistent_keys_are_plain_orbax_keys(open_manager, dirs, mesh):
  mgr = open_manager()
  states = _save_range(mgr, mesh, range(0, 5))
  mgr.close()
  abstract = abstract_of(states[4])
  with ocp.CheckpointManager(dirs[1]) as plain:
    out = plain.restore(4, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
  assert_state_equal(out.state, states[4])


def test_parent_style_restores_keys_from_ram_with_only_shardings(shm_dir, mesh):
  """The parent-style form restores `ArrayRestoreArgs(sharding=...)` (no target shape) from
  RAM: the SavedLeaf path."""
  full = key_state(mesh, 12)
  state = {"w": full["params"]["w"], **full["rngs"]}
  options = ocp.CheckpointManagerOptions(save_interval_steps=1)
  with mtc.CheckpointManager(shm_dir / "p", options=options,
                             local_directory=shm_dir / "ram") as mgr:
    mgr.save(3, args=ocp.args.PyTreeSave(state))
    mgr.wait_until_finished()
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), state)
    restored = mgr.restore(3, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    assert mgr.last_restore.tier == "local"
    assert_state_equal(restored, state)


# ----------------------------------------------------------------------------- two processes


def test_keys_come_back_from_a_peer_copy_bit_exact(shm_root, tmp_path):
  """2 processes x 2 devices: node 1's RAM folder is wiped after the save; its key shards
  (sharded over processes, and replicated) come back from node 0's copy."""
  persistent = tmp_path / "persistent"
  common = ["--persistent-dir", str(persistent), "--keys", "--local-interval", "2",
            "--local-keep", "2", "--persistent-interval", "100"]
  result, out = run_job(["save", "--steps", "7", *common], 2, shm_root)
  assert_ok(result, out)
  shutil.rmtree(shm_root / "node1")
  (shm_root / "node1").mkdir()
  result, out = run_job(["restore", *common], 2, shm_root)
  assert_ok(result, out)
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == [0, 1], tail(out)
  assert [(results[n]["step"], results[n]["tier"], results[n]["ok"]) for n in (0, 1)] == [
      ("6", "local", "1"), ("6", "peer", "1")], tail(out)
  manifest = read_manifest(shm_root / "node1" / "6")  # written back, keys included
  impls = {leaf.path: leaf.key_impl for leaf in manifest.items["state"].leaves if leaf.key_impl}
  assert impls == {"['rngs']['dropout']": "unsafe_rbg", "['rngs']['params']": "threefry2x32"}
