"""The RAM-disk tier on its own: staging, atomic commit, manifest, verify, retention, read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid

import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import abstract_of, assert_trees_equal, flip_byte, make_state

from orbax_mtc.local import read as local_read
from orbax_mtc.local.format import (
  DATA,
  MANIFEST,
  AbstractStateMismatchError,
  CorruptStepError,
  LocalTierError,
  StepManifest,
)
from orbax_mtc.local.read import (
  arrays_from_buffer,
  manifest_entries,
  read_data,
  read_step,
  shard_crc,
  verify_buffer,
  verify_step,
)
from orbax_mtc.local.specs import item_metadata, normalize_index
from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier, committed_steps, read_manifest

pytestmark = pytest.mark.timeout(60)


def _write(tier, mesh, step, seed=None, default_item=False):
  state = make_state(mesh, seed=step if seed is None else seed)
  staged = stage(step, {"state": state}, {"meta": {"step": step}}, default_item=default_item)
  return state, tier.write(staged, process_index=0, process_count=1)


def _first_shard(manifest):
  leaf = manifest.items["state"].leaves[0]
  return leaf, leaf.shards[0]


@pytest.fixture
def tier(shm_dir):
  tier = LocalTier(shm_dir / "local", max_to_keep=2)
  tier.prepare()
  yield tier
  tier.close()


def test_write_commit_read_round_trip(tier, mesh):
  state, step_dir = _write(tier, mesh, 3)
  assert step_dir == tier.directory / "3"
  assert sorted(p.name for p in step_dir.iterdir()) == [DATA, MANIFEST]
  assert committed_steps(tier.directory) == [3]
  manifest = read_manifest(step_dir)
  assert manifest.step == 3 and manifest.process_count == 1 and not manifest.default_item
  assert manifest.data_size == (step_dir / DATA).stat().st_size
  assert manifest.items["meta"].kind == "json" and manifest.items["meta"].value == {"step": 3}
  restored = read_step(step_dir, manifest, {"state": abstract_of(state), "meta": None})
  assert restored["meta"] == {"step": 3}
  assert_trees_equal(restored["state"], state)
  # verify_step agrees and returns the same manifest.
  assert verify_step(step_dir) == manifest


def test_manifest_json_round_trip(tier, mesh):
  _, step_dir = _write(tier, mesh, 1)
  manifest = read_manifest(step_dir)
  assert StepManifest.from_json(manifest.to_json()) == manifest
  paths = [leaf.path for leaf in manifest.items["state"].leaves]
  assert "['params']['w']" in paths and "['layers'][0]" in paths
  w = next(leaf for leaf in manifest.items["state"].leaves if leaf.path == "['params']['w']")
  assert w.shape == (8, 6) and w.dtype == "float32" and w.kind == "array"
  # P("data", "model") on 2x2: four distinct shards of 4x3, each with its own checksum.
  assert sorted(s.index for s in w.shards) == [((0, 4), (0, 3)), ((0, 4), (3, 6)),
                                               ((4, 8), (0, 3)), ((4, 8), (3, 6))]
  assert all(s.nbytes == 4 * 3 * 4 for s in w.shards)
  b = next(leaf for leaf in manifest.items["state"].leaves if leaf.path == "['params']['b']")
  assert b.dtype == "bfloat16" and len(b.shards) == 2  # P("model"): twins along "data"
  ids = next(leaf for leaf in manifest.items["state"].leaves if leaf.path == "['ids']")
  assert len(ids.shards) == 1  # replicated: written once
  step = next(leaf for leaf in manifest.items["state"].leaves if leaf.path == "['step']")
  assert step.kind == "host" and step.python_type == "int"


def test_item_metadata_from_manifest(tier, mesh):
  state, step_dir = _write(tier, mesh, 2)
  meta = item_metadata(read_manifest(step_dir))
  assert meta.meta == {"step": 2}
  tree = meta.state
  assert tree["params"]["w"] == jax.ShapeDtypeStruct((8, 6), np.float32)
  assert tree["params"]["b"].dtype == jax.numpy.bfloat16
  assert isinstance(tree["layers"], list) and tree["layers"][0].shape == (4, 2)
  assert tree["scale"].shape == ()
  assert tree["host"].shape == state["host"].shape


def test_default_item_metadata_is_bare_tree(tier, mesh):
  state = make_state(mesh, 1)
  staged = stage(1, {"default": state}, {}, default_item=True)
  step_dir = tier.write(staged, 0, 1)
  meta = item_metadata(read_manifest(step_dir))
  assert set(meta) == set(state)


def test_committed_steps_ignores_everything_but_committed_folders(tier, mesh):
  _write(tier, mesh, 4)
  root = tier.directory
  (root / ".tmp-6-abc").mkdir()
  shutil.copytree(root / "4", root / ".tmp-8-def")  # complete, but never renamed
  (root / "10").mkdir()  # no manifest
  (root / "12").write_text("not a folder")
  (root / "abc").mkdir()
  assert committed_steps(root) == [4]
  assert committed_steps(root / "missing") == []
  with pytest.raises(LocalTierError, match="not a committed step"):
    read_manifest(root / "10")


def test_prepare_removes_interrupted_saves_and_extra_spares(shm_dir, mesh):
  tier = LocalTier(shm_dir / "local", max_to_keep=1)
  tier.prepare()
  _write(tier, mesh, 2)
  root = tier.directory
  for name in (".tmp-4-x", ".spare-a", ".spare-b"):
    (root / name).mkdir()
    (root / name / DATA).write_bytes(b"x" * 100)
  tier.close()
  again = LocalTier(root, max_to_keep=1)
  again.prepare()
  names = sorted(p.name for p in root.iterdir())
  assert "2" in names
  assert not [n for n in names if n.startswith(".tmp-")]
  assert len([n for n in names if n.startswith(".spare-")]) == 1
  again.close()


def test_retention_keeps_max_to_keep_and_reuses_a_spare(tier, mesh):
  saved = {}
  for step in range(0, 12, 2):
    saved[step], _ = _write(tier, mesh, step)
    steps = committed_steps(tier.directory)
    assert steps == sorted(saved)[-2:]
    names = [p.name for p in tier.directory.iterdir()]
    assert len([n for n in names if n.startswith(".spare-")]) <= 1
    assert not [n for n in names if n.startswith(".tmp-")]
  # Steps written into a reused spare data file read back exactly.
  for step in (8, 10):
    manifest = tier.manifest(step)
    restored = read_step(tier.directory / str(step), manifest,
                         {"state": abstract_of(saved[step])})
    assert_trees_equal(restored["state"], saved[step])


def test_a_step_being_sent_is_kept_and_two_retired_at_once_leave_two_spares(tier, mesh):
  """The step whose peer copies are going out is kept beside `max_to_keep` (rule 10); with
  `spares=2` (copies spread over intervals: two steps retire at once when they land) both
  retired files are kept, and the next two writes reuse them, not fresh pages."""
  tier.spares = 2
  for step in (1, 2):
    _write(tier, mesh, step)
  tier.keep_sending = 1
  _write(tier, mesh, 3)
  assert committed_steps(tier.directory) == [1, 2, 3]
  tier.keep_replicated, tier.keep_sending = 3, None  # step 1's copies landed
  _write(tier, mesh, 4)  # 1 and 2 retire together
  spares = [p for p in tier.directory.iterdir() if p.name.startswith(".spare-")]
  assert committed_steps(tier.directory) == [3, 4] and len(spares) == 2
  # The next writes reuse those files (or step 3's, retired meanwhile), never new ones.
  reusable = {(p / DATA).stat().st_ino for p in spares} | {
      (tier.directory / "3" / DATA).stat().st_ino}
  tier.keep_replicated = 4
  _write(tier, mesh, 5)
  _write(tier, mesh, 6)
  assert committed_steps(tier.directory) == [4, 5, 6]
  assert {(tier.directory / str(s) / DATA).stat().st_ino for s in (5, 6)} <= reusable


def test_retention_never_drops_the_newest(shm_dir, mesh):
  tier = LocalTier(shm_dir / "local", max_to_keep=1)
  tier.prepare()
  try:
    for step in (5, 6, 7):
      _write(tier, mesh, step)
      assert committed_steps(tier.directory) == [step]
  finally:
    tier.close()


def test_spare_reuse_with_a_smaller_state_truncates(tier, mesh):
  big = make_state(mesh, 1, scale=8)
  for step in (1, 2, 3):
    tier.write(stage(step, {"state": big}, {}, default_item=False), 0, 1)
  small = make_state(mesh, 4)
  step_dir = tier.write(stage(4, {"state": small}, {}, default_item=False), 0, 1)
  manifest = verify_step(step_dir)
  assert (step_dir / DATA).stat().st_size == manifest.data_size
  restored = read_step(step_dir, manifest, {"state": abstract_of(small)})
  assert_trees_equal(restored["state"], small)


def test_commit_existing_step_fails_and_keeps_it(tier, mesh):
  state, _ = _write(tier, mesh, 2)
  with pytest.raises(FileExistsError):
    _write(tier, mesh, 2, seed=99)
  restored = read_step(tier.directory / "2", tier.manifest(2), {"state": abstract_of(state)})
  assert_trees_equal(restored["state"], state)
  assert not [p for p in tier.directory.iterdir() if p.name.startswith(".tmp-")]


def test_flipped_byte_detected_by_verify_and_read(tier, mesh):
  state, step_dir = _write(tier, mesh, 2)
  manifest = read_manifest(step_dir)
  leaf, shard = _first_shard(manifest)
  flip_byte(step_dir / DATA, shard.offset + shard.nbytes // 2)
  with pytest.raises(CorruptStepError, match=r"checksum mismatch") as info:
    verify_step(step_dir)
  assert leaf.path in str(info.value)
  with pytest.raises(CorruptStepError, match="checksum mismatch"):
    read_step(step_dir, manifest, {"state": abstract_of(state)})


def test_checksums_computed_while_reading_match_and_catch_a_flip(tier, mesh, monkeypatch):
  # Pieces smaller than a shard and not aligned to one: the follower waits mid-shard.
  monkeypatch.setattr(local_read, "_PIPELINE_PIECE", 1000)
  state, step_dir = _write(tier, mesh, 2)
  manifest = read_manifest(step_dir)
  crcs: dict = {}
  data = read_data(step_dir, manifest, crcs)
  entries = manifest_entries(manifest)
  assert len(crcs) == len({(s.offset, s.nbytes) for _, _, s in entries}) > 1
  for _, _, shard in entries:
    assert crcs[(shard.offset, shard.nbytes)] == shard.crc32c == shard_crc(
        data, shard.offset, shard.nbytes)
  verify_buffer(data, manifest, "here", crcs)
  _, shard = _first_shard(manifest)
  flip_byte(step_dir / DATA, shard.offset + shard.nbytes - 1)
  crcs = {}
  data = read_data(step_dir, manifest, crcs)
  with pytest.raises(CorruptStepError, match="checksum mismatch"):
    verify_buffer(data, manifest, "here", crcs)
  with pytest.raises(CorruptStepError, match="checksum mismatch"):
    arrays_from_buffer(data, manifest, {"state": abstract_of(state)}, "here", crcs=crcs)


def test_truncated_data_detected(tier, mesh):
  state, step_dir = _write(tier, mesh, 2)
  manifest = read_manifest(step_dir)
  os.truncate(step_dir / DATA, manifest.data_size // 2)
  with pytest.raises(CorruptStepError):
    verify_step(step_dir)
  with pytest.raises(LocalTierError):
    read_step(step_dir, manifest, {"state": abstract_of(state)})
  (step_dir / DATA).unlink()
  with pytest.raises(LocalTierError):
    verify_step(step_dir)
  with pytest.raises(LocalTierError):
    read_step(step_dir, manifest, {"state": abstract_of(state)})


def test_garbage_manifest_is_a_local_tier_error(tier, mesh):
  _, step_dir = _write(tier, mesh, 2)
  (step_dir / MANIFEST).write_text("{not json")
  with pytest.raises(LocalTierError, match="unreadable"):
    read_manifest(step_dir)
  (step_dir / MANIFEST).write_text('{"format": "something/else"}')
  with pytest.raises(LocalTierError, match="format"):
    read_manifest(step_dir)


@pytest.mark.parametrize("change", ["shape", "dtype", "missing_leaf", "extra_leaf", "item"])
def test_read_step_rejects_mismatched_target(tier, mesh, change):
  state, step_dir = _write(tier, mesh, 2)
  target = abstract_of(state)
  w = target["params"]["w"]
  if change == "shape":
    target["params"]["w"] = jax.ShapeDtypeStruct((8, 12), w.dtype, sharding=w.sharding)
    expected = [r"\['params'\]\['w'\]", r"\(8, 6\)", r"\(8, 12\)"]
  elif change == "dtype":  # PRNG keys where floats were saved: no cast reaches them
    keys = jax.random.key(0).dtype
    target["params"]["w"] = jax.ShapeDtypeStruct(w.shape, keys, sharding=w.sharding)
    expected = [r"\['params'\]\['w'\]", "float32", re.escape(keys.name)]
  elif change == "missing_leaf":
    del target["params"]["b"]
    expected = [r"\['params'\]\['b'\]"]
  elif change == "extra_leaf":
    target["params"]["extra"] = w
    expected = [r"\['params'\]\['extra'\]"]
  else:
    target = {"other": target}
    expected = ["'other'"]
  targets = target if change == "item" else {"state": target}
  with pytest.raises(AbstractStateMismatchError) as info:
    read_step(step_dir, read_manifest(step_dir), targets)
  for pattern in expected:
    assert re.search(pattern, str(info.value)), (pattern, str(info.value))
  assert verify_step(step_dir)  # nothing was touched


def test_read_step_casts_a_target_of_another_dtype_as_orbax(tier, mesh):
  """Issue 44: another dtype is cast on the host with TensorStore's cast driver (Orbax's read
  path, so the same bits as Orbax's); an `UncastLeaf` target refuses it."""
  state, step_dir = _write(tier, mesh, 2)
  target = abstract_of(state)
  w = target["params"]["w"]
  target["params"]["w"] = bf16 = jax.ShapeDtypeStruct(w.shape, "bfloat16", sharding=w.sharding)
  target["host"] = np.zeros(state["host"].shape, np.float32)
  restored = read_step(step_dir, read_manifest(step_dir), {"state": target})["state"]
  for got, saved in ((restored["params"]["w"], state["params"]["w"]),
                     (restored["host"], state["host"])):
    assert got.dtype != saved.dtype
    want = ts.cast(ts.array(np.asarray(saved)), ts.dtype(got.dtype.name)).read().result()
    assert np.asarray(got).tobytes() == want.tobytes()
  assert restored["params"]["w"].sharding == w.sharding
  uncast = dict(target, params=dict(target["params"], w=local_read.UncastLeaf(bf16)))
  with pytest.raises(AbstractStateMismatchError, match="float32.*bfloat16"):
    read_step(step_dir, read_manifest(step_dir), {"state": uncast})


def test_read_onto_host_targets(tier, mesh):
  """A target without sharding reads a replicated array as numpy (the node holds it whole)."""
  state, step_dir = _write(tier, mesh, 2)
  target = abstract_of(state)
  target["ids"] = np.zeros((4, 4), np.int32)
  restored = read_step(step_dir, read_manifest(step_dir), {"state": target})["state"]
  assert isinstance(restored["ids"], np.ndarray)
  assert np.array_equal(restored["ids"], np.asarray(state["ids"]))
  # A sharded leaf has no whole copy here: the target is at fault (no other copy helps).
  target["params"]["w"] = np.zeros((8, 6), np.float32)
  with pytest.raises(AbstractStateMismatchError, match="does not hold the whole array") as info:
    read_step(step_dir, read_manifest(step_dir), {"state": target})
  assert "['params']['w']" in str(info.value) and "P('data', 'model')" in str(info.value)


def test_unsupported_leaf_type_rejected(mesh):
  with pytest.raises(TypeError, match="cannot store"):
    stage(0, {"state": {"x": "a string"}}, {}, default_item=False)
  with pytest.raises(TypeError, match="not JSON-serialisable"):
    stage(0, {}, {"meta": {"x": object()}}, default_item=False)


def test_prepare_rejects_a_file(shm_dir):
  path = shm_dir / "afile"
  path.write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    LocalTier(path, max_to_keep=1).prepare()


@pytest.fixture
def read_only_dir(shm_dir):
  """A read-only tmpfs mount (enforced for root too); skipped where mounting is not allowed."""
  mount = shm_dir / f"ro-{uuid.uuid4().hex[:8]}"
  mount.mkdir()
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
  if result.returncode != 0:
    pytest.skip(f"cannot mount a read-only tmpfs here: {result.stderr.strip()}")
  try:
    yield mount
  finally:
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_prepare_rejects_read_only_directory(read_only_dir):
  with pytest.raises(ValueError, match="not writable"):
    LocalTier(read_only_dir, max_to_keep=1).prepare()
  with pytest.raises(ValueError, match="Cannot create local_directory"):
    LocalTier(read_only_dir / "sub", max_to_keep=1).prepare()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (chmod 0o500)")
def test_prepare_rejects_non_writable_directory(shm_dir):
  path = shm_dir / "ro"
  path.mkdir()
  path.chmod(0o500)
  try:
    with pytest.raises(ValueError, match="not writable"):
      LocalTier(path, max_to_keep=1).prepare()
  finally:
    path.chmod(0o700)


def test_stage_holds_jax_shards_in_place_and_copies_host_leaves(tier, mesh):
  state = make_state(mesh, 3)
  want = {**state, "host": state["host"].copy()}
  staged = stage(1, {"state": state}, {}, default_item=False)
  shard_views = [np.asarray(s.data) for leaf in jax.tree.leaves(state)
                 if isinstance(leaf, jax.Array) for s in leaf.addressable_shards]
  in_place = [piece for _, piece in staged.pieces
              if any(np.shares_memory(piece, v) for v in shard_views)]
  # One piece per distinct shard of each jax array, none a copy (on CPU, the array's buffer).
  distinct = sum(len({normalize_index(s.index, leaf.shape) for s in leaf.addressable_shards})
                 for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array))
  assert len(in_place) == distinct
  assert not any(np.shares_memory(piece, state["host"]) for _, piece in staged.pieces)
  state["host"][:] = -1.0  # the caller may change a numpy leaf once save returns
  step_dir = tier.write(staged, 0, 1)
  restored = read_step(step_dir, verify_step(step_dir), {"state": abstract_of(want)})
  assert_trees_equal(restored["state"], want)


def test_manifest_records_the_saved_sharding(tier, mesh):
  _, step_dir = _write(tier, mesh, 2)
  leaves = {leaf.path: leaf for leaf in read_manifest(step_dir).items["state"].leaves}
  assert leaves["['params']['w']"].sharding == (
      "NamedSharding(mesh={'data': 2, 'model': 2}, spec=P('data', 'model'), "
      "devices=[0, 1, 2, 3])")
  assert leaves["['ids']"].sharding == (
      "NamedSharding(mesh={'data': 2, 'model': 2}, spec=P(), devices=[0, 1, 2, 3])")
  assert leaves["['host']"].sharding is None and leaves["['step']"].sharding is None


@pytest.mark.parametrize("layout", ["other_spec", "other_mesh"])
def test_restore_onto_another_sharding_is_an_abstract_state_mismatch(tier, mesh, layout):
  """Same shapes and dtypes, another layout whose shards this node did not save: the target is
  at fault (no other copy of the step helps), named with both shardings."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  state, step_dir = _write(tier, mesh, 2)
  target = abstract_of(state)
  w = target["params"]["w"]
  if layout == "other_spec":
    other = NamedSharding(mesh, P("model", None))
    want = "NamedSharding(mesh={'data': 2, 'model': 2}, spec=P('model', None), devices="
  else:
    other = NamedSharding(jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]), P("x"))
    want = "NamedSharding(mesh={'x': 4}, spec=P('x',), devices="
  target["params"]["w"] = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=other)
  manifest = read_manifest(step_dir)
  crcs: dict = {}
  data = read_data(step_dir, manifest, crcs)
  with pytest.raises(AbstractStateMismatchError) as info:
    arrays_from_buffer(data, manifest, {"state": target}, str(step_dir), crcs=crcs)
  message = str(info.value)
  assert "['params']['w']" in message and want in message, message
  assert "NamedSharding(mesh={'data': 2, 'model': 2}, spec=P('data', 'model'), devices=" \
      in message
  assert not isinstance(info.value, LocalTierError)
  # Through read_step too; the step itself is fine.
  with pytest.raises(AbstractStateMismatchError, match="target sharding differs"):
    read_step(step_dir, manifest, {"state": target})
  verify_step(step_dir)


@pytest.mark.parametrize("with_layout", [False, True], ids=["no-layout", "layout"])
def test_missing_shard_under_the_saved_sharding_is_a_local_tier_error(tier, mesh, with_layout):
  """The saved sharding, but a shard this node does not hold (its devices changed since the
  save): without the step's layout the copy is unusable here, and restore may try another
  source; with it (`tiles`), ReshardNeeded: an elastic restore rebuilds the step."""
  import dataclasses

  from orbax_mtc.local.read import ReshardNeeded

  state, step_dir = _write(tier, mesh, 2)
  manifest = read_manifest(step_dir)
  item = manifest.items["state"]
  leaves = tuple(dataclasses.replace(leaf, shards=leaf.shards[1:],
                                     tiles=leaf.tiles if with_layout else None)
                 if leaf.path == "['params']['w']" else leaf for leaf in item.leaves)
  partial = dataclasses.replace(
      manifest, items={**manifest.items, "state": dataclasses.replace(item, leaves=leaves)})
  data = read_data(step_dir, manifest)
  error = ReshardNeeded if with_layout else LocalTierError
  with pytest.raises(error, match="devices differ"):
    arrays_from_buffer(data, partial, {"state": abstract_of(state)}, str(step_dir))


def test_forced_old_save_applies_retention_before_on_commit(shm_dir, mesh):
  """RAM holds 7, 8, 9 (max_to_keep=3); a forced save of 5 is retired at once: on_commit (the
  LKG link) gets the newest step, 9, never the retired 5."""
  committed = []
  tier = LocalTier(shm_dir / "local", max_to_keep=3, on_commit=committed.append)
  tier.prepare()
  try:
    for step in (7, 8, 9):
      _write(tier, mesh, step)
    assert committed == [7, 8, 9]
    _write(tier, mesh, 5)
    assert committed == [7, 8, 9, 9]
    assert not (tier.directory / "5").exists()
    assert tier.steps() == [7, 8, 9]
    _write(tier, mesh, 10)  # a normal save: on_commit gets it, 7 is retired
    assert committed[-1] == 10 and tier.steps() == [8, 9, 10]
  finally:
    tier.close()
