"""Named manifest corruptions and peer stream headers: each raises LocalTierError (ManifestError), never anything else."""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from manifest_support import (
  HEADER_VALUES,
  HYPOTHESIS,
  STEP,
  W,
  _big_size,
  _bool_index,
  _bool_step,
  _copy_store,
  _crc_range,
  _created_at,
  _host_partial,
  _huge_size,
  _index_out_of_range,
  _item_list,
  _keys_list,
  _leaves_null,
  _negative_offset,
  _no_shards,
  _overlap,
  _python_type,
  _set_dtype,
  _set_rank,
  _shrink,
  _wrong_nbytes,
  edited,
  framed,
  put,
  sign,
  stream_bytes,
)

from orbax_mtc.local.format import (
  DATA,
  FORMAT,
  MANIFEST,
  MANIFEST_CRC_KEY,
  CorruptStepError,
  LocalTierError,
  ManifestError,
  StepManifest,
  manifest_checksum,
)
from orbax_mtc.local.read import (
  manifest_entries,
  read_data,
  verify_step,
)
from orbax_mtc.local.specs import item_metadata
from orbax_mtc.local.store import LocalTier, committed_steps, is_step_name, read_manifest
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import stream as peer_stream

pytestmark = pytest.mark.timeout(300)


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
def test_named_field_corruptions(manifest_step, edit, pattern):
  tier, step_dir, pristine, raw = manifest_step
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
def test_manifest_that_is_not_an_object(manifest_step, text):
  tier, step_dir, pristine, _ = manifest_step
  put(step_dir, pristine, text)
  with pytest.raises(ManifestError, match=str(step_dir / MANIFEST)):
    tier.manifest(STEP)


def test_unsigned_edit_is_caught_by_the_checksum(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
  changed = dict(raw, created_at=raw["created_at"] + 1)
  put(step_dir, pristine, changed)
  with pytest.raises(ManifestError, match="checksum mismatch"):
    read_manifest(step_dir)
  put(step_dir, pristine, {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY})
  with pytest.raises(ManifestError, match=MANIFEST_CRC_KEY):
    read_manifest(step_dir)
  put(step_dir, pristine, raw)
  assert read_manifest(step_dir) == StepManifest.from_json(json.dumps(raw))


def test_other_formats_are_refused(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
  put(step_dir, pristine, sign(dict(raw, format="orbax-mtc/local/1")))
  with pytest.raises(ManifestError, match="another version"):
    read_manifest(step_dir)
  put(step_dir, pristine, sign(dict(raw, format=None)))
  with pytest.raises(ManifestError, match="unknown manifest format"):
    read_manifest(step_dir)


def test_checksum_is_over_the_canonical_json(manifest_step):
  _, _, _, raw = manifest_step
  assert raw["format"] == FORMAT == "orbax-mtc/local/2"
  assert sign(raw) == raw
  body = {k: v for k, v in raw.items() if k != MANIFEST_CRC_KEY}
  assert manifest_checksum(body) == raw[MANIFEST_CRC_KEY] == raw["manifest_crc32c"]
  # Key order and spacing do not matter, only the content.
  text = json.dumps(dict(reversed(list(raw.items()))), indent=3)
  assert StepManifest.from_json(text) == StepManifest.from_json(json.dumps(raw))


def test_step_that_does_not_match_the_folder(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
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


def test_process_index_and_count_mismatch(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
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


def test_data_file_shorter_than_data_size(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
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
def test_non_ascii_or_non_decimal_folder_names_are_not_steps(manifest_step, name):
  tier, step_dir, pristine, raw = manifest_step
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


def test_old_manifest_without_sharding_reads_as_none(manifest_step):
  _, _, _, raw = manifest_step
  out = copy.deepcopy(raw)
  for leaf in out["items"]["state"]["leaves"]:
    del leaf["sharding"]
  manifest = StepManifest.from_json(json.dumps(sign(out)))
  assert all(leaf.sharding is None for leaf in manifest.items["state"].leaves)
  described = StepManifest.from_json(json.dumps(raw))
  w = next(leaf for leaf in described.items["state"].leaves if leaf.path == W)
  assert w.sharding == ("NamedSharding(mesh={'data': 2, 'model': 2}, spec=P('data', 'model'), "
                        "devices=[0, 1, 2, 3])")


def test_conflicting_key_paths_are_a_manifest_error_in_item_metadata(manifest_step):
  _, _, _, raw = manifest_step
  out = copy.deepcopy(raw)
  leaves = out["items"]["state"]["leaves"]
  # One leaf's key path runs through another leaf.
  leaves[1]["keys"] = leaves[0]["keys"] + [["dict", "below"]]
  manifest = StepManifest.from_json(json.dumps(sign(out)))
  with pytest.raises(ManifestError, match="runs through another leaf"):
    item_metadata(manifest)


@HYPOTHESIS
@given(header=HEADER_VALUES)
def test_a_copy_whose_header_is_malformed_is_refused_never_raised(header):
  """Whatever a received stream's header holds, its commit refuses it (None, logged) and
  leaves nothing behind: the copy is simply not held, and no error escapes the commit."""
  if isinstance(header, dict) and header.get("format") is None:
    header = dict(header, format=peer_stream.STREAM_FORMAT)
  buffer = framed(header, b"\0" * 256)
  with tempfile.TemporaryDirectory() as tmp:
    store = _copy_store(Path(tmp))
    incoming = store.begin(0, STEP, buffer.nbytes)
    incoming.write(0, buffer)
    assert incoming.commit(None) is None
    assert store.copies() == []
    assert not list(store.source_dir(0).iterdir())


def test_peer_copy_round_trip_and_malformed_copy_headers(manifest_step, tmp_path):
  tier, step_dir, pristine, raw = manifest_step
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
  assert got == manifest
  # Every shard's bytes (the alignment gaps between them are not sent: zeros in the copy).
  original = read_data(step_dir, manifest)
  for _, _, shard in manifest_entries(manifest):
    span = slice(shard.offset, shard.offset + shard.nbytes)
    assert data[span].tobytes() == original[span].tobytes()

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
def test_malformed_copy_records_are_local_tier_errors(manifest_step, tmp_path, content):
  tier, step_dir, pristine, raw = manifest_step
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


def test_peer_copy_with_a_resigned_bad_manifest_is_refused(manifest_step, tmp_path):
  tier, step_dir, pristine, raw = manifest_step
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


def test_a_retired_copy_is_the_next_copys_data_file(manifest_step, tmp_path):
  """Retention turns a retired copy into its source's spare (un-committed, never listed),
  and the next copy from that source is written into the spare's data file (its pages
  touched already), cut to the new stream's length and read back bit-exact."""
  tier, step_dir, pristine, raw = manifest_step
  put(step_dir, pristine, raw)
  manifest = read_manifest(step_dir)
  good = stream_bytes(peer_stream.copy_stream(step_dir, manifest, 0, set()))
  store = _copy_store(tmp_path)

  def deliver() -> Path | None:
    incoming = store.begin(0, STEP, good.nbytes)
    incoming.write(0, good)
    return incoming.commit(None)

  committed = deliver()
  peer_store._retire(committed)
  spares = [p for p in store.source_dir(0).iterdir() if p.name.startswith(".spare-")]
  assert store.copies() == [] and len(spares) == 1
  data = spares[0] / "data.bin"
  with open(data, "ab") as f:  # a longer old copy: its tail must not survive
    f.write(b"\xff" * 8192)
  inode = data.stat().st_ino
  committed = deliver()
  assert (committed / "data.bin").stat().st_ino == inode
  assert (committed / "data.bin").stat().st_size == good.nbytes
  assert not [p for p in store.source_dir(0).iterdir() if p.name.startswith(".spare-")]
  got, read = store.read(0, STEP, tmp_path / "holder" / str(STEP))
  want = read_data(step_dir, manifest)
  assert got == manifest  # and every shard bit-exact (the gaps between are not read)
  for _, _, shard in manifest_entries(manifest):
    span = slice(shard.offset, shard.offset + shard.nbytes)
    assert read[span].tobytes() == want[span].tobytes()
  # With a spare already there, or a copy being received (it found none: a spare kept now
  # would add a step's worth of RAM), a retired copy is removed.
  for other in (".spare-other", ".tmp-9-other"):
    committed = deliver()
    (store.source_dir(0) / other).mkdir()
    peer_store._retire(committed)
    assert store.copies() == []
    assert [p.name for p in store.source_dir(0).iterdir()] == [other]
    (store.source_dir(0) / other).rmdir()
