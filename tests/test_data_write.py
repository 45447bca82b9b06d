"""Writing a step's data file (orbax_mtc.local.data_write): gathered system calls, short
writes resumed, and several threads copying into a mapping of one file, bit-exact."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import abstract_of, assert_trees_equal, make_state

from orbax_mtc.local import data_write
from orbax_mtc.local.read import read_step, verify_step
from orbax_mtc.local.staging import StagedStep, stage
from orbax_mtc.local.store import LocalTier


def test_write_views_gathers_small_views_and_resumes_short_writes(shm_dir, monkeypatch):
  rng = np.random.default_rng(0)
  views = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in
           (0, 1, 250, 7, 0, 5, 6, 8, 64, 1000, 3, 99, 2)]
  monkeypatch.setattr(data_write, "WRITE_CHUNK", 100)  # splits and batches at small sizes
  monkeypatch.setattr(data_write, "IOV_MAX", 3)
  real_pwritev, real_pwrite = os.pwritev, os.pwrite
  calls = []

  def short_pwritev(fd, buffers, offset):  # the kernel may write less than asked
    calls.append(len(buffers))
    return real_pwritev(fd, [bytes(b)[:17] for b in buffers[:1]], offset)

  monkeypatch.setattr(os, "pwritev", short_pwritev)
  monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real_pwrite(fd, bytes(data)[:40],
                                                                         offset))
  path = shm_dir / "data.bin"
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    data_write.write_views(fd, views)
  finally:
    os.close(fd)
  assert path.read_bytes() == b"".join(bytes(v) for v in views)
  assert max(calls) == 3 and len(calls) < sum(-(-v.nbytes // 100) for v in views)


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_views_cuts_aligned_runs_that_cover_the_bytes_once(parts):
  rng = np.random.default_rng(1)
  views = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in
           (0, 300, 17, 1024, 5, 0, 2000, 64)]
  runs = data_write.split_views(views, parts, align=256)
  assert 1 <= len(runs) <= parts
  joined = b"".join(bytes(v) for v in views)
  at = 0
  for i, (start, run) in enumerate(runs):
    assert start == at
    size = sum(v.nbytes for v in run)
    if i < len(runs) - 1:
      assert size % 256 == 0
    assert b"".join(bytes(v) for v in run) == joined[start:start + size]
    at += size
  assert at == len(joined)


def test_a_step_written_by_several_threads_is_the_same_file(shm_dir, mesh, monkeypatch):
  """Several threads copy disjoint ranges into a mapping of one data file; the step reads
  back bit-exact, and a thread that fails raises only once every thread is done."""
  monkeypatch.setattr(data_write, "PARALLEL_MIN_BYTES", 1)
  monkeypatch.setattr(data_write, "RUN_ALIGN", 4096)
  tier = LocalTier(shm_dir / "parallel", max_to_keep=2, write_threads=3)
  tier.prepare()
  try:
    want = make_state(mesh, 5, scale=64)
    for step in (7, 8):  # a new file, then a reused one
      step_dir = tier.write(stage(step, {"state": want}, {}, default_item=False), 0, 1)
      restored = read_step(step_dir, verify_step(step_dir), {"state": abstract_of(want)})
      assert_trees_equal(restored["state"], want)
    real = data_write._copy_runs
    started = []

    def failing(target, runs, first, step):
      started.append(first)
      if first:
        raise OSError(28, "No space left on device")
      return real(target, runs, first, step)

    monkeypatch.setattr(data_write, "_copy_runs", failing)
    with pytest.raises(OSError, match="No space left"):
      tier.write(stage(9, {"state": want}, {}, default_item=False), 0, 1)
    assert sorted(started) == [0, 1, 2] and tier.steps() == [7, 8]  # nothing committed
  finally:
    tier.close()


@pytest.mark.parametrize("missing", ["posix_fallocate", "mmap"])
def test_a_file_system_without_fallocate_or_mmap_is_written_by_one_thread(shm_dir, monkeypatch,
                                                                          missing):
  monkeypatch.setattr(data_write, "PARALLEL_MIN_BYTES", 1)

  def unsupported(*args, **kwargs):
    raise OSError(errno.EOPNOTSUPP if missing == "posix_fallocate" else errno.ENODEV,
                  "not supported")

  if missing == "posix_fallocate":
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
  else:
    monkeypatch.setattr(data_write.mmap, "mmap", unsupported)
  views = [memoryview(np.arange(n, dtype=np.uint8)) for n in (10, 0, 300)]
  path = shm_dir / "data.bin"
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    try:
      data_write.write_parallel(fd, views, pool, 2)
    finally:
      os.close(fd)
  assert path.read_bytes() == b"".join(bytes(v) for v in views)


def test_the_write_threads_benchmark_runs_here(shm_dir):
  """benchmarks/write_threads.py (a phase of benchmarks/gpu_suite.sh, where a failure costs
  scarce device time) runs here at the size where several threads take over."""
  repo = Path(__file__).resolve().parents[1]
  done = subprocess.run(
      [sys.executable, str(repo / "benchmarks" / "write_threads.py"), "--mib", "64",
       "--threads", "1", "2", "--reps", "1", "--root", str(shm_dir / "wt")],
      capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  assert [line.split()[0] for line in done.stdout.splitlines()] == ["1", "2"]
  assert not (shm_dir / "wt").exists()


def test_a_reused_file_takes_the_arrays_bytes_in_place(shm_dir, mesh, monkeypatch):
  """A step staged as views of CPU arrays' buffers (`device_copy`), written into a retired
  step's file, is copied straight into that file's pages (no pool copy), its checksums
  following the copy; it reads back bit-exact and lets go of the arrays' buffers. A file
  without such a spare, or a larger step than the spare held, takes the pool's path."""
  real = data_write.write_in_place
  used: list[bool] = []

  def spy(*args, **kwargs):
    values = real(*args, **kwargs)
    used.append(values is not None)
    return values

  monkeypatch.setattr(data_write, "write_in_place", spy)
  tier = LocalTier(shm_dir / "inplace", max_to_keep=1)
  tier.prepare()
  try:
    for step, scale in ((1, 64), (2, 64), (3, 64), (4, 128)):
      want = make_state(mesh, step, scale=scale)
      staged = stage(step, {"state": want}, {}, default_item=False, device_copy=True)
      assert staged.borrowed  # views of the arrays' own buffers, on CPU
      step_dir = tier.write(staged, 0, 1)
      assert not staged.borrowed  # the arrays' buffers are let go of (copied in place or out)
      if step == 3:
        assert not staged.pieces  # in place: the step is only in the file
      restored = read_step(step_dir, verify_step(step_dir), {"state": abstract_of(want)})
      assert_trees_equal(restored["state"], want)
    # Step 1: a new file; 2: the first retired file is only spared at 2's commit; 3: in
    # place; 4: larger than the spare (its pages would be new): the pool's path.
    assert used == [True, False], used
    assert tier.steps() == [4]
  finally:
    tier.close()


def test_copy_into_fills_the_file_bytes_and_says_how_far_it_got(mesh):
  """`StagedStep.copy_into` lays out data.bin as `views` does (pieces at their offsets, the
  gaps as zeros) and reports every chunk's end, in order, up to the step's size."""
  staged = stage(1, {"state": make_state(mesh, 3, scale=64)}, {}, default_item=False)
  want = b"".join(bytes(view) for view in staged.views())
  target = np.full(staged.size, 0xFF, np.uint8)  # not zeros: the gaps must be written
  ends: list[int] = []
  staged.copy_into(target, ends.append, chunk_bytes=96)
  assert target.tobytes() == want
  assert ends == sorted(ends) and ends[-1] == staged.size and len(ends) > 3
  assert staged.pieces == [] and not staged.borrowed


def test_an_in_place_copy_that_fails_commits_nothing_and_frees_the_checksums(
    shm_dir, mesh, monkeypatch):
  """A copy into the reused file's mapping that fails half-way raises its own error once the
  checksum thread, which waits for the bytes it reads, has given up; nothing is committed
  and the step before stays."""
  tier = LocalTier(shm_dir / "failing", max_to_keep=1)
  tier.prepare()
  want = make_state(mesh, 1, scale=64)
  try:
    for step in (1, 2):  # step 1's file is the spare step 3 is written into
      tier.write(stage(step, {"state": want}, {}, default_item=False, device_copy=True), 0, 1)

    def half(self, target, copied, chunk_bytes=0):
      target[:self.size // 2] = 1
      copied(self.size // 2)
      raise OSError(errno.EIO, "copy failed")

    monkeypatch.setattr(StagedStep, "copy_into", half)
    with pytest.raises(OSError, match="copy failed"):
      tier.write(stage(3, {"state": want}, {}, default_item=False, device_copy=True), 0, 1)
    assert tier.steps() == [2]
    verify_step(shm_dir / "failing" / "2")
  finally:
    tier.close()
  copied = data_write.Copied()
  copied.advance(10)
  copied.until(10)
  copied.stop()
  with pytest.raises(RuntimeError, match="stopped at byte 10, before 11"):
    copied.until(11)


def test_the_write_in_place_benchmark_runs_here(shm_dir):
  """benchmarks/write_in_place.py runs here, both ways, and removes its files."""
  repo = Path(__file__).resolve().parents[1]
  done = subprocess.run(
      [sys.executable, str(repo / "benchmarks" / "write_in_place.py"), "--mib", "8",
       "--reps", "1", "--root", str(shm_dir / "wip")],
      capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
      "in place", "buffer", "in place / buffer"], done.stdout
  assert not (shm_dir / "wip").exists()
