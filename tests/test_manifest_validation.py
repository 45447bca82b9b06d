"""A manifest that is valid JSON but wrong raises LocalTierError (ManifestError), never anything
else: generated corruptions of a real manifest, named cases, and the peer stream headers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from manifest_support import HYPOTHESIS, JSON_VALUES, canonical, corruptions, put, read_all, sign

from orbax_mtc.local.format import (
  FORMAT,
  MANIFEST_CRC_KEY,
  LocalTierError,
  ManifestError,
  StepManifest,
)
from orbax_mtc.local.store import read_manifest

pytestmark = pytest.mark.timeout(300)


def test_generated_corruptions_resigned_reach_the_field_validators(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
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


def test_generated_unsigned_edits_are_caught_by_the_checksum(manifest_step):
  tier, step_dir, pristine, raw = manifest_step
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
