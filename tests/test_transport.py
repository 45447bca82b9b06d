"""The chunked `ppermute` transport between 3 real JAX processes: streams of odd sizes in
both directions around the ring plus a longer one, in chunks far smaller than the streams
(so every round ends with a short chunk), issued one chunk per call first and then all at
once; every process checks each stream it received byte for byte (`mp_worker transport`)."""

from __future__ import annotations

import ast
import re
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, new_root, tail

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("chunk_bytes", [4096, 65536])
def test_streams_arrive_bit_exact_in_small_chunks(chunk_bytes):
  root = new_root(f"transport-{chunk_bytes}")
  try:
    result, out = mp_helpers.run_job(
        ["transport", "--chunk-bytes", str(chunk_bytes)], 3, root, devices=1, timeout_s=120)
    assert_ok(result, out)
    lines = [m.groups() for m in map(
        re.compile(r"TRANSPORT process=(\d+) streams=(\d+) bad=(\[.*?\]) calls=(\d+)").search,
        out.lines) if m]
    assert sorted(int(p) for p, *_ in lines) == [0, 1, 2], tail(out)
    for process, streams, bad, calls in lines:
      assert bad == "[]", f"process {process} got corrupt streams {bad}\n{tail(out)}"
      # Every process receives from both of its neighbours (the long stream replaces 0 -> 2).
      assert int(streams) == 2, tail(out)
      assert int(calls) == 6, "the stepwise phase should not have finished every chunk"
  finally:
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("fault", ["read", "place", "sink"])
def test_a_failure_mid_transfer_leaves_no_process_inside_a_collective(fault):
  """Process 1's reader, chunk placement or sink fails from its third chunk on: every process
  still completes every chunk (zeros or a spare chunk go out, the bytes are dropped), the
  failure is recorded for the caller's agreement, and only streams that involve the failing
  side differ from what was sent."""
  root = new_root(f"transport-fault-{fault}")
  try:
    result, out = mp_helpers.run_job(
        ["transport", "--chunk-bytes", "4096", "--fault", fault], 3, root, devices=1,
        timeout_s=120)
    assert_ok(result, out)
    lines = {int(m.group(1)): (ast.literal_eval(m.group(2)), int(m.group(3))) for m in map(
        re.compile(r"TRANSPORT process=(\d+) .*bad=(\[.*?\]) .*failures=(\d+)").search,
        out.lines) if m}
    assert sorted(lines) == [0, 1, 2], tail(out)
    assert lines[1][1] >= 1 and lines[0][1] == lines[2][1] == 0, lines
    bad = {(src, dst) for dst, (sources, _) in lines.items() for src in sources}
    if fault == "sink":
      assert bad and all(dst == 1 for _, dst in bad), bad
    else:
      assert bad and all(src == 1 for src, _ in bad), bad
  finally:
    shutil.rmtree(root, ignore_errors=True)
