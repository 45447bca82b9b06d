"""The chunked `ppermute` transport between 3 real JAX processes: streams of odd sizes in
both directions around the ring plus a longer one, in chunks far smaller than the streams
(so every round ends with a short chunk), issued one chunk per call first and then all at
once; every process checks each stream it received byte for byte (`mp_worker transport`)."""

from __future__ import annotations

import ast
import concurrent.futures
import re
import shutil

import jax
import mp_helpers
import numpy as np
import pytest
from mp_helpers import assert_ok, new_root, tail

from orbax_mtc.local import staging
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import stream as peer_stream

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("chunk_bytes,devices", [(4096, 1), (65536, 1), (4096, 2), (65536, 2)])
def test_streams_arrive_bit_exact_in_small_chunks(chunk_bytes, devices):
  """With two CPU devices per process each chunk travels in two parts (node_mesh.py)."""
  root = new_root(f"transport-{chunk_bytes}-{devices}")
  try:
    result, out = mp_helpers.run_job(
        ["transport", "--chunk-bytes", str(chunk_bytes)], 3, root, devices=devices,
        timeout_s=120)
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


@pytest.mark.parametrize("devices", [1, 2])
def test_chunks_left_moving_and_the_next_training_step_never_deadlock(devices):
  """400 rounds of a peer chunk left moving then an all-reduce over every device: the
  CPU client starts them in the same order on every process (node_mesh.py). A one-device
  chunk beside a two-device step hung every job tried, within about 50 rounds."""
  root = new_root(f"transport-race-{devices}")
  try:
    result, out = mp_helpers.run_job(["chunk-race", "--rounds", "400"], 2, root,
                                     devices=devices, timeout_s=90)
    assert not result.timed_out, f"the job hung (chunk and step deadlocked)\n{tail(out)}"
    assert_ok(result, out)
    lines = [line for line in out.lines if "RACE process=" in line]
    assert len(lines) == 2 and all("bad=0 state=1" in line for line in lines), tail(out)
  finally:
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("fault,devices", [("read", 1), ("place", 1), ("sink", 1), ("place", 2)])
def test_a_failure_mid_transfer_leaves_no_process_inside_a_collective(fault, devices):
  """Process 1's reader, chunk placement or sink fails from its third chunk on: every process
  still completes every chunk (zeros or a spare chunk go out, the bytes are dropped), the
  failure is recorded for the caller's agreement, and only streams that involve the failing
  side differ from what was sent."""
  root = new_root(f"transport-fault-{fault}-{devices}")
  try:
    result, out = mp_helpers.run_job(
        ["transport", "--chunk-bytes", "4096", "--fault", fault], 3, root, devices=devices,
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


def test_a_read_ahead_stream_lends_its_chunks_within_its_budget(tmp_path):
  """A stream read ahead in chunks gives the same bytes as reading it (gaps and the tail
  past its end as zeros), each chunk once, from aligned buffers; no more than the budget is
  read and not yet taken, and a chunk whose read failed is None (the sender reads it)."""
  tier = local_store.LocalTier(tmp_path / "local", max_to_keep=2)
  tier.prepare()
  thread = concurrent.futures.ThreadPoolExecutor(1)
  try:
    state = {"a": np.arange(3000, dtype=np.float32), "b": np.arange(17, dtype=np.int8)}
    tier.write(staging.stage(3, {"state": state}, {}, default_item=False), 0, 2)
    manifest = tier.manifest(3)
    reference = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    stream = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    assert stream.view(0, 4096) is None  # not read ahead yet
    submitted = []

    def submit(fn, *args):  # the read runs before view asks for it (deterministic)
      submitted.append(args[0])
      future = thread.submit(fn, *args)
      concurrent.futures.wait([future])
      return future

    stream.read_ahead(4096, 8192, submit)
    assert submitted == [0, 4096]  # the budget: two chunks ahead
    padded = -(-stream.nbytes // 4096) * 4096
    want = np.zeros(padded, np.uint8)
    reference.read(0, want[:stream.nbytes])
    assert stream.view(100, 4096) is None  # no chunk starts there
    got = []
    for offset in range(0, padded, 4096):
      chunk = stream.view(offset, 4096)
      assert chunk is not None and chunk.ctypes.data % 4096 == 0, offset
      got.append(chunk.copy())
    assert np.array_equal(np.concatenate(got), want)
    assert submitted == list(range(0, padded, 4096))  # each chunk read once, in order
    assert stream.view(0, 4096) is None  # taken already

    # A read that fails: the sender reads the chunk itself (and meets the error there).
    broken = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    broken.segments[1].path = tmp_path / "gone"
    broken.read_ahead(4096, 4096, submit)
    assert broken.view(0, 4096) is None
    with pytest.raises(OSError):
      broken.read(0, np.zeros(4096, np.uint8))
    # A chunk longer than the one read ahead is not lent; dropped reads are not lent either.
    other = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    other.read_ahead(4096, 8192, submit)
    assert other.view(0, 8192) is None
    other.cancel_read_ahead()
    assert other.view(4096, 4096) is None
    # A read still queued behind the thread's other work is not waited for: None, dropped.
    queued = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    pending = []
    queued.read_ahead(4096, 4096, lambda fn, *args: pending.append(
        concurrent.futures.Future()) or pending[-1])
    assert queued.view(0, 4096) is None and pending[0].cancelled()

    # Placed ahead on the reader thread: a chunk taken whole is handed out as placed (the
    # same bytes), a shorter one as a view of its buffer; a chunk whose placement failed
    # as a view too (the sender places it).
    device = jax.local_devices()[0]
    placed = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    placed.read_ahead(4096, 8192, submit, place=lambda b: jax.device_put(b, device))
    whole = placed.view(0, 4096)
    assert isinstance(whole, jax.Array) and np.array_equal(np.asarray(whole), want[:4096])
    part = placed.view(4096, 1024)
    assert isinstance(part, np.ndarray) and np.array_equal(part, want[4096:5120])

    def refuse(buffer):
      raise RuntimeError("no room on the device")

    unplaced = peer_stream.copy_stream(tier.directory / "3", manifest, 0, skip=set())
    unplaced.read_ahead(4096, 4096, submit, place=refuse)
    chunk = unplaced.view(0, 4096)
    assert isinstance(chunk, np.ndarray) and np.array_equal(chunk, want[:4096])
  finally:
    thread.shutdown()
    tier.close()
