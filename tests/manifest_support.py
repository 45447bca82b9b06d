"""Helpers and fixtures shared by test_manifest_validation.py and test_manifest_cases.py."""

from __future__ import annotations

import copy
import json
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
from conftest import SHM_ROOT, make_state
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from orbax_mtc.local.format import (
  DATA,
  MANIFEST,
  MANIFEST_CRC_KEY,
  MAX_DATA_SIZE,
  LocalTierError,
  StepManifest,
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
from orbax_mtc.local.store import LocalTier, read_manifest
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import stream as peer_stream

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
def manifest_step(mesh):
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


def _copy_store(tmp: Path) -> peer_store.PeerStore:
  (tmp / "holder").mkdir(exist_ok=True)
  return peer_store.PeerStore(tmp / "holder", max_to_keep=None)
