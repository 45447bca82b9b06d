"""A manifest that is valid JSON but wrong raises LocalTierError (ManifestError), never anything
else: generated corruptions of a real manifest, named cases, and the peer stream headers."""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
from conftest import SHM_ROOT, make_state
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from orbax_mtc.local.format import (
  DATA,
  FORMAT,
  MANIFEST,
  MANIFEST_CRC_KEY,
  MAX_DATA_SIZE,
  CorruptStepError,
  LocalTierError,
  ManifestError,
  StepManifest,
  manifest_checksum,
)
from orbax_mtc.local.read import (
  aligned_empty,
  manifest_entries,
  read_data,
  verify_buffer,
  verify_step,
)
from orbax_mtc.local.specs import item_metadata
from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier, committed_steps, is_step_name, read_manifest
from orbax_mtc.peers import store as peer_store
from orbax_mtc.peers import stream as peer_stream

pytestmark = pytest.mark.timeout(300)

STEP = 3
HYPOTHESIS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow])


def sign(raw: dict[str, Any]) -> dict[str, Any]:
  """`raw` with its manifest checksum recomputed, as the spec says: CRC32C of the canonical JSON
  (sorted keys, compact separators) of every other field."""
  fields = {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY}
  text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
  return {**fields, MANIFEST_CRC_KEY: google_crc32c.value(text.encode())}


def canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True, separators=(",", ":"))


@pytest.fixture(scope="module")
def saved(mesh):
  """A real committed step (sharded jax arrays, numpy and scalar leaves, a JSON item) and a
  pristine copy of its folder; yields (tier, step folder, pristine folder, parsed manifest)."""
  base = (SHM_ROOT or Path("/tmp")) / f"orbax-mtc-test-manifest-{uuid.uuid4().hex[:12]}"
  tier = LocalTier(base / "local", max_to_keep=None)
  tier.prepare()
  staged = stage(STEP, {"state": make_state(mesh, seed=1)}, {"meta": {"step": STEP, "x": [1]}},
                 default_item=False)
  step_dir = tier.write(staged, process_index=0, process_count=1)
  pristine = base / "pristine"
  shutil.copytree(step_dir, pristine)
  raw = json.loads((step_dir / MANIFEST).read_text())
  yield tier, step_dir, pristine, raw
  tier.close()
  shutil.rmtree(base, ignore_errors=True)


def put(step_dir: Path, pristine: Path, manifest: Any) -> None:
  """Restores the step folder, then writes `manifest` (a JSON value or raw text)."""
  for name in (DATA, MANIFEST):
    shutil.copyfile(pristine / name, step_dir / name)
  text = manifest if isinstance(manifest, str) else json.dumps(manifest)
  (step_dir / MANIFEST).write_text(text)


def read_all(tier: LocalTier, step_dir: Path) -> StepManifest:
  """Every reader of a step folder: the manifest, its checksums, its metadata tree. Each may
  refuse the step with a LocalTierError, nothing else."""
  manifest = read_manifest(step_dir)
  assert tier.manifest(STEP) == manifest
  assert StepManifest.from_json(manifest.to_json()) == manifest
  for _, _, shard in manifest_entries(manifest):
    assert 0 <= shard.offset and shard.offset + shard.nbytes <= manifest.data_size
  try:
    item_metadata(manifest)
    verify_step(step_dir)
    crcs: dict = {}
    data = read_data(step_dir, manifest, crcs)
    verify_buffer(data, manifest, "test", crcs)
  except LocalTierError:
    pass
  return manifest


# ----------------------------------------------------------------------------- generated


def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
  """Every path (keys and list indices) into a JSON value, the root excluded."""
  out = []
  if isinstance(value, dict):
    items = value.items()
  elif isinstance(value, list):
    items = enumerate(value)
  else:
    return out
  for key, child in items:
    out.append(prefix + (key,))
    out.extend(paths_of(child, prefix + (key,)))
  return out


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)

REPLACEMENTS = st.one_of(
    st.sampled_from([None, [], [0, 0], "x", "", "float33", True, False, 2**63, 2**64 + 1,
                     10**30, -1, -(2**63), 0, 1, 7, 1.5, {}, {"a": 1}, [[0, 1]], [[0, 9999]],
                     "bfloat16", "int64", ">f4", "object", "(2,)f4", MAX_DATA_SIZE]),
    JSON_VALUES)


@st.composite
def corruptions(draw, raw: dict[str, Any]) -> tuple[dict[str, Any] | Any, str]:
  """(corrupted manifest JSON, what was done) from the pristine parsed manifest."""
  body = {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY}
  path = draw(st.sampled_from(paths_of(body)))
  action = draw(st.sampled_from(["replace", "replace", "replace", "drop", "overlap",
                                 "out_of_range"]))
  mutated = copy.deepcopy(body)
  parent = mutated
  for key in path[:-1]:
    parent = parent[key]
  last = path[-1]
  if action == "drop":
    del parent[last]
  elif action == "overlap":
    # Another shard's offset: two shards share bytes (when both hold any).
    shards = [s for it in mutated["items"].values() for leaf in it["leaves"]
              for s in leaf["shards"]]
    a, b = draw(st.sampled_from(shards)), draw(st.sampled_from(shards))
    a[1] = b[1] + draw(st.integers(0, max(0, b[2] - 1)))
  elif action == "out_of_range":
    shards = [(leaf, s) for it in mutated["items"].values() for leaf in it["leaves"]
              for s in leaf["shards"]]
    leaf, shard = draw(st.sampled_from(shards))
    if shard[0]:
      dim = draw(st.integers(0, len(shard[0]) - 1))
      shard[0][dim][draw(st.sampled_from([0, 1]))] = draw(st.sampled_from(
          [leaf["shape"][dim] + 1, -1, 2**63, leaf["shape"][dim] * 2 + 5]))
    else:
      shard[0] = [[0, 1]]
  else:
    parent[last] = draw(REPLACEMENTS)
  return mutated, f"{action} at {path}"


def test_generated_corruptions_resigned_reach_the_field_validators(saved):
  tier, step_dir, pristine, raw = saved
  seen = {"ok": 0, "refused": 0}

  @HYPOTHESIS
  @given(data=st.data())
  def run(data):
    mutated, what = data.draw(corruptions(raw))
    note(what)
    put(step_dir, pristine, sign(mutated))
    try:
      read_all(tier, step_dir)
      seen["ok"] += 1
    except LocalTierError:
      seen["refused"] += 1

  run()
  # Both outcomes occur: the generator reaches past the checksum into the field checks.
  assert seen["ok"] > 0 and seen["refused"] > seen["ok"], seen


def test_generated_unsigned_edits_are_caught_by_the_checksum(saved):
  tier, step_dir, pristine, raw = saved
  pristine_body = canonical({k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY})

  @HYPOTHESIS
  @given(data=st.data())
  def run(data):
    mutated, what = data.draw(corruptions(raw))
    note(what)
    mutated[MANIFEST_CRC_KEY] = raw[MANIFEST_CRC_KEY]  # the old checksum, not re-signed
    put(step_dir, pristine, mutated)
    unchanged = canonical({k: v for k, v in mutated.items()
                           if k != MANIFEST_CRC_KEY}) == pristine_body
    if unchanged:  # a no-op edit (the same value written back) reads back identically
      assert read_all(tier, step_dir) == StepManifest.from_json(json.dumps(raw))
      return
    with pytest.raises(ManifestError):
      read_manifest(step_dir)

  run()


@HYPOTHESIS
@given(value=JSON_VALUES)
def test_any_json_value_is_refused_with_a_manifest_error(value):
  with pytest.raises(ManifestError):
    StepManifest.from_json(json.dumps(value))
  if isinstance(value, dict):
    with pytest.raises(ManifestError):
      StepManifest.from_json(json.dumps(sign({**value, "format": FORMAT})))


@HYPOTHESIS
@given(text=st.text(max_size=50) | st.binary(max_size=50))
def test_any_text_is_refused_with_a_manifest_error(text):
  with pytest.raises(ManifestError):
    StepManifest.from_json(text)


def test_deeply_nested_json_is_a_manifest_error():
  with pytest.raises(ManifestError):
    StepManifest.from_json("[" * 100_000 + "]" * 100_000)
  with pytest.raises(ManifestError):
    StepManifest.from_json(12)  # not text at all


# ----------------------------------------------------------------------------- named cases


def leaf_of(raw: dict[str, Any], path: str) -> dict[str, Any]:
  return next(leaf for leaf in raw["items"]["state"]["leaves"] if leaf["path"] == path)


def edited(raw: dict[str, Any], edit) -> dict[str, Any]:
  out = copy.deepcopy(raw)
  edit(out)
  return sign(out)


W = "['params']['w']"


def _set_dtype(r):
  leaf_of(r, W)["dtype"] = "float33"


def _set_rank(r):
  leaf_of(r, W)["shape"] = [8]


def _shrink(r):
  leaf_of(r, W)["shape"] = [4, 6]


def _huge_size(r):
  r["data_size"] = 2**62


def _big_size(r):
  r["data_size"] += 4096


def _index_out_of_range(r):
  leaf_of(r, W)["shards"][0][0][0] = [0, 9]


def _negative_offset(r):
  leaf_of(r, W)["shards"][0][1] = -64


def _overlap(r):
  shards = leaf_of(r, W)["shards"]
  shards[1][1] = shards[0][1] + 8


def _wrong_nbytes(r):
  leaf_of(r, W)["shards"][0][2] += 4


def _bool_step(r):
  r["step"] = True


def _bool_index(r):
  r["process_index"] = False


def _leaves_null(r):
  r["items"]["state"]["leaves"] = None


def _item_list(r):
  r["items"]["state"] = []


def _no_shards(r):
  del leaf_of(r, W)["shards"]


def _host_partial(r):
  leaf_of(r, "['host']")["shards"][0][0] = [[0, 2]]
  leaf_of(r, "['host']")["shards"][0][2] = 16


def _python_type(r):
  leaf_of(r, W)["python_type"] = "str"


def _keys_list(r):
  leaf_of(r, W)["keys"] = [["dict", ["unhashable"]]]


def _crc_range(r):
  leaf_of(r, W)["shards"][0][3] = 2**32


def _created_at(r):
  r["created_at"] = "yesterday"


@pytest.mark.parametrize("edit, pattern", [
    (_set_dtype, "'dtype' holds 'float33'"),
    (_set_rank, "index holds"),
    (_shrink, "index stop holds"),
    (_huge_size, "'data_size' holds"),
    (_big_size, "exceeds the .* bytes its shards take"),
    (_index_out_of_range, "index stop holds 9"),
    (_negative_offset, "offset holds -64"),
    (_overlap, "overlap"),
    (_wrong_nbytes, "nbytes holds"),
    (_bool_step, "'step' holds True"),
    (_bool_index, "'process_index' holds False"),
    (_leaves_null, "'leaves' holds None"),
    (_item_list, "item 'state' holds"),
    (_no_shards, "has no field 'shards'"),
    (_host_partial, "not the whole array"),
    (_python_type, "python_type"),
    (_keys_list, "key holds"),
    (_crc_range, "crc32c holds"),
    (_created_at, "'created_at' holds"),
])
def test_named_field_corruptions(saved, edit, pattern):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, edited(raw, edit))
  with pytest.raises(ManifestError, match=pattern) as info:
    read_manifest(step_dir)
  assert str(step_dir / MANIFEST) in str(info.value)  # names the file
  # The same edit without re-signing is caught by the checksum first.
  unsigned = edited(raw, edit)
  unsigned[MANIFEST_CRC_KEY] = raw[MANIFEST_CRC_KEY]
  put(step_dir, pristine, unsigned)
  with pytest.raises(ManifestError, match="checksum mismatch"):
    read_manifest(step_dir)


@pytest.mark.parametrize("text", ["null", "[]", "[1, 2]", '"text"', "12", "true", "{}"])
def test_manifest_that_is_not_an_object(saved, text):
  tier, step_dir, pristine, _ = saved
  put(step_dir, pristine, text)
  with pytest.raises(ManifestError, match=str(step_dir / MANIFEST)):
    tier.manifest(STEP)


def test_unsigned_edit_is_caught_by_the_checksum(saved):
  tier, step_dir, pristine, raw = saved
  changed = dict(raw, created_at=raw["created_at"] + 1)
  put(step_dir, pristine, changed)
  with pytest.raises(ManifestError, match="checksum mismatch"):
    read_manifest(step_dir)
  put(step_dir, pristine, {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY})
  with pytest.raises(ManifestError, match=MANIFEST_CRC_KEY):
    read_manifest(step_dir)
  put(step_dir, pristine, raw)
  assert read_manifest(step_dir) == StepManifest.from_json(json.dumps(raw))


def test_other_formats_are_refused(saved):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, sign(dict(raw, format="orbax-mtc/local/1")))
  with pytest.raises(ManifestError, match="another version"):
    read_manifest(step_dir)
  put(step_dir, pristine, sign(dict(raw, format=None)))
  with pytest.raises(ManifestError, match="unknown manifest format"):
    read_manifest(step_dir)


def test_checksum_is_over_the_canonical_json(saved):
  _, _, _, raw = saved
  assert raw["format"] == FORMAT == "orbax-mtc/local/2"
  assert sign(raw) == raw
  body = {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY}
  assert manifest_checksum(body) == raw[MANIFEST_CRC_KEY] == raw["manifest_crc32c"]
  # Key order and spacing do not matter, only the content.
  text = json.dumps(dict(reversed(list(raw.items()))), indent=3)
  assert StepManifest.from_json(text) == StepManifest.from_json(json.dumps(raw))


def test_step_that_does_not_match_the_folder(saved):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, sign(dict(raw, step=STEP + 1)))
  with pytest.raises(ManifestError, match=rf"'step' holds {STEP + 1}, expected {STEP}"):
    read_manifest(step_dir)
  # The same folder under another (step) name: its manifest says STEP.
  put(step_dir, pristine, raw)
  moved = step_dir.parent / "11"
  shutil.copytree(step_dir, moved)
  try:
    with pytest.raises(ManifestError, match=rf"'step' holds {STEP}, expected 11"):
      read_manifest(moved)
  finally:
    shutil.rmtree(moved)


def test_process_index_and_count_mismatch(saved):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  assert LocalTier(tier.directory, max_to_keep=None, process_index=0,
                   process_count=1).manifest(STEP).step == STEP
  other = LocalTier(tier.directory, max_to_keep=None, process_index=1, process_count=2)
  with pytest.raises(ManifestError) as info:
    other.manifest(STEP)
  assert str(step_dir) in str(info.value)
  assert "'process_index' holds 0, expected 1" in str(info.value)
  count = LocalTier(tier.directory, max_to_keep=None, process_index=0, process_count=2)
  with pytest.raises(ManifestError, match="'process_count' holds 1, expected 2"):
    count.manifest(STEP)
  # Inconsistent in itself: an index beyond the count.
  put(step_dir, pristine, sign(dict(raw, process_index=1)))
  with pytest.raises(ManifestError, match="'process_index' holds 1"):
    read_manifest(step_dir)
  for tier_ in (other, count):
    tier_.close()


def test_data_file_shorter_than_data_size(saved):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  os.truncate(step_dir / DATA, raw["data_size"] - 1)
  with pytest.raises(LocalTierError, match="shorter than"):
    read_manifest(step_dir)
  with pytest.raises(LocalTierError):
    read_data(step_dir, StepManifest.from_json(json.dumps(raw)))
  (step_dir / DATA).unlink()
  with pytest.raises(LocalTierError, match=f"no {DATA}"):
    read_manifest(step_dir)
  put(step_dir, pristine, raw)
  # A data file longer than needed is fine for reading (verify_step wants the exact size).
  with open(step_dir / DATA, "ab") as f:
    f.write(b"\0" * 10)
  assert read_manifest(step_dir).step == STEP
  with pytest.raises(CorruptStepError):
    verify_step(step_dir)
  put(step_dir, pristine, raw)


@pytest.mark.parametrize("name", ["²", "٣", "1²", "+5", " 5", "5 ", "0x5", "-1"])
def test_non_ascii_or_non_decimal_folder_names_are_not_steps(saved, name):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  odd = tier.directory / name
  shutil.copytree(step_dir, odd)
  try:
    assert not is_step_name(name)
    assert committed_steps(tier.directory) == [STEP]
    with pytest.raises(ManifestError, match="not a step number"):
      read_manifest(odd)
  finally:
    shutil.rmtree(odd)
  assert is_step_name("0") and is_step_name("123")


def test_old_manifest_without_sharding_reads_as_none(saved):
  _, _, _, raw = saved
  out = copy.deepcopy(raw)
  for leaf in out["items"]["state"]["leaves"]:
    del leaf["sharding"]
  manifest = StepManifest.from_json(json.dumps(sign(out)))
  assert all(leaf.sharding is None for leaf in manifest.items["state"].leaves)
  described = StepManifest.from_json(json.dumps(raw))
  w = next(leaf for leaf in described.items["state"].leaves if leaf.path == W)
  assert w.sharding == ("NamedSharding(mesh={'data': 2, 'model': 2}, spec=P('data', 'model'), "
                        "devices=[0, 1, 2, 3])")


def test_conflicting_key_paths_are_a_manifest_error_in_item_metadata(saved):
  _, _, _, raw = saved
  out = copy.deepcopy(raw)
  leaves = out["items"]["state"]["leaves"]
  # One leaf's key path runs through another leaf.
  leaves[1]["keys"] = leaves[0]["keys"] + [["dict", "below"]]
  manifest = StepManifest.from_json(json.dumps(sign(out)))
  with pytest.raises(ManifestError, match="runs through another leaf"):
    item_metadata(manifest)


# ----------------------------------------------------------------------------- peer streams


def stream_bytes(stream: peer_stream.OutgoingStream) -> np.ndarray:
  buffer = aligned_empty(stream.nbytes)
  buffer[:] = 0
  stream.read(0, buffer)
  return buffer


def framed(header: Any, body: bytes = b"") -> np.ndarray:
  text = json.dumps(header).encode()
  raw = struct.pack("<Q", len(text)) + text
  raw += b"\0" * (-len(raw) % 64) + body
  return np.frombuffer(raw, dtype=np.uint8).copy()


HEADER_VALUES = st.one_of(JSON_VALUES, st.dictionaries(
    st.sampled_from(["format", "kind", "manifest", "source", "step", "layout"]),
    JSON_VALUES | st.just(peer_stream.STREAM_FORMAT) | st.sampled_from(["step", "copy"]),
    max_size=6))


@HYPOTHESIS
@given(header=HEADER_VALUES)
def test_received_step_refuses_malformed_headers_with_local_tier_errors(header):
  if isinstance(header, dict) and header.get("format") is None:
    header = dict(header, format=peer_stream.STREAM_FORMAT)
  with pytest.raises(LocalTierError):
    peer_stream.received_step(framed(header, b"\0" * 256))


def test_received_step_round_trip_and_named_header_faults(saved):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  manifest = read_manifest(step_dir)
  data = read_data(step_dir, manifest)
  buffer = stream_bytes(peer_stream.step_stream(manifest, data))
  got, got_data = peer_stream.received_step(buffer)
  assert got == manifest and got_data.tobytes() == data.tobytes()
  fmt = peer_stream.STREAM_FORMAT
  for header in ([1, 2], None, {"format": fmt}, {"format": fmt, "kind": "step"},
                 {"format": fmt, "kind": "step", "manifest": 5},
                 {"format": fmt, "kind": "step", "manifest": {"step": 1}},
                 {"format": fmt, "kind": "step", "manifest": "null"},
                 {"format": fmt, "kind": "step", "manifest": json.dumps(raw)[:-5]}):
    with pytest.raises(LocalTierError):
      peer_stream.received_step(framed(header, data.tobytes()))
  with pytest.raises(LocalTierError, match="shorter"):  # the data is cut short
    peer_stream.received_step(buffer[:buffer.nbytes - 64])
  for cut in (0, 4, 9):
    with pytest.raises(LocalTierError):
      peer_stream.received_step(buffer[:cut])


def _copy_store(tmp: Path) -> peer_store.PeerStore:
  (tmp / "holder").mkdir(exist_ok=True)
  return peer_store.PeerStore(tmp / "holder", max_to_keep=None)


def test_peer_copy_round_trip_and_malformed_copy_headers(saved, tmp_path):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  manifest = read_manifest(step_dir)
  good = stream_bytes(peer_stream.copy_stream(step_dir, manifest, 0, set()))
  store = _copy_store(tmp_path)

  def deliver(buffer: np.ndarray, step: int = STEP) -> Path | None:
    incoming = store.begin(0, step, buffer.nbytes)
    incoming.write(0, buffer)
    return incoming.commit(None)

  assert deliver(good) is not None
  assert store.copies() == [(0, STEP)]
  got, data = store.read(0, STEP, tmp_path / "holder" / str(STEP))
  assert got == manifest and data.tobytes() == read_data(step_dir, manifest).tobytes()

  header, start = peer_stream.parse_stream_header(good)
  body = good[start:].tobytes()
  entries = len(manifest_entries(manifest))
  faults = [
      [1], None, {"format": peer_stream.STREAM_FORMAT},
      dict(header, source=True), dict(header, source="0"), dict(header, step=str(STEP)),
      dict(header, kind=None), dict(header, manifest=None), dict(header, manifest=["x"]),
      dict(header, layout=None), dict(header, layout=[0] * (entries - 1)),
      dict(header, layout=["0"] * entries), dict(header, layout=[True] * entries),
      dict(header, layout=[-2] * entries), dict(header, layout=[2**62] * entries),
      dict(header, layout=[2**70] * entries),
      dict(header, manifest=json.dumps(sign(dict(raw, process_index=1, process_count=2)))),
      dict(header, manifest=json.dumps(sign(dict(raw, data_size=2**62)))),
  ]
  for fault in faults:
    assert deliver(framed(fault, body)) is None, fault
  assert deliver(framed(header, body), step=STEP + 1) is None  # another step's stream
  # Stream framing: shorter than the length field, a length beyond the stream.
  assert deliver(good[:5]) is None
  bad_length = good.copy()
  bad_length[:8] = np.frombuffer(struct.pack("<Q", 2**64 - 1), np.uint8)
  assert deliver(bad_length) is None
  assert store.copies() == [(0, STEP)]  # the good copy stays, no failed one appears
  assert not [p for p in store.source_dir(0).iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("content", [
    "null", "[]", "{not json", '{"format": "orbax-mtc/peer-copy/1"}',
    '{"format": "orbax-mtc/peer-copy/1", "source": 0, "step": 3, "layout": null}',
    '{"format": "orbax-mtc/peer-copy/1", "source": 0, "step": 3, "layout": [true]}',
    '{"format": "orbax-mtc/peer-copy/1", "source": 0, "step": 3, "layout": [-5]}',
    '{"format": "orbax-mtc/peer-copy/1", "source": 1, "step": 3, "layout": []}',
    '{"format": "orbax-mtc/peer-copy/1", "source": 0, "step": 4, "layout": []}',
    "LAYOUT_BEYOND", "LAYOUT_HUGE"])
def test_malformed_copy_records_are_local_tier_errors(saved, tmp_path, content):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  manifest = read_manifest(step_dir)
  store = _copy_store(tmp_path)
  buffer = stream_bytes(peer_stream.copy_stream(step_dir, manifest, 0, set()))
  incoming = store.begin(0, STEP, buffer.nbytes)
  incoming.write(0, buffer)
  folder = incoming.commit(None)
  assert folder is not None
  meta = json.loads((folder / peer_store.COPY_META).read_text())
  if content == "LAYOUT_BEYOND":
    content = json.dumps(dict(meta, layout=[x + buffer.nbytes for x in meta["layout"]]))
  elif content == "LAYOUT_HUGE":
    content = json.dumps(dict(meta, layout=[2**62 for _ in meta["layout"]]))
  (folder / peer_store.COPY_META).write_text(content)
  with pytest.raises(LocalTierError):
    store.read(0, STEP, tmp_path / "holder" / str(STEP))
  assert store.servable([]) in ([], [(0, STEP)])


def test_peer_copy_with_a_resigned_bad_manifest_is_refused(saved, tmp_path):
  tier, step_dir, pristine, raw = saved
  put(step_dir, pristine, raw)
  manifest = read_manifest(step_dir)
  store = _copy_store(tmp_path)
  buffer = stream_bytes(peer_stream.copy_stream(step_dir, manifest, 0, set()))
  incoming = store.begin(0, STEP, buffer.nbytes)
  incoming.write(0, buffer)
  folder = incoming.commit(None)
  for bad in (sign(dict(raw, process_index=0, process_count=1, step=STEP + 1)),
              sign(dict(raw, data_size=raw["data_size"] + 4096)), [1], None):
    (folder / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(LocalTierError):
      store.read(0, STEP, tmp_path / "holder" / str(STEP))
