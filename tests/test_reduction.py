"""A gathered round (reduction.row_bytes + combine_rows) reduces to what an all-reduce gives
(reduction.combine), and a round is gathered only while every row together stays small."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_mtc import reduction


def _contributions(seed: int, shape: tuple[int, int, int], processes: int):
  rng = np.random.default_rng(seed)
  add, top, flags = shape
  return [reduction.Parts(rng.integers(-2**20, 2**20, add, dtype=np.int32),
                          rng.integers(reduction.LOW, 2**31 - 1, top, dtype=np.int32),
                          rng.integers(0, 2, flags, dtype=np.uint8))
          for _ in range(processes)]


@pytest.mark.parametrize("shape", [(5, 3, 7), (0, 4, 0), (3, 0, 9), (1, 1, 1), (0, 0, 0)])
@pytest.mark.parametrize("processes", [1, 2, 5])
def test_gathered_rows_reduce_like_the_all_reduce(shape, processes):
  parts = _contributions(sum(shape) * 10 + processes, shape, processes)
  rows = np.stack([reduction.row_bytes(p) for p in parts])
  padding = np.full((processes, 3), 0xAB, np.uint8)  # the collective pads each row
  got = reduction.combine_rows(np.concatenate([rows, padding], axis=1), shape)
  want = reduction.combine(parts)
  for name in ("add", "top", "flags"):
    assert getattr(got, name).dtype == getattr(want, name).dtype
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_a_round_is_gathered_only_while_small():
  limit = reduction.GATHERED_ROUND_BYTES
  assert reduction.gathers(limit // 4, 4) and not reduction.gathers(limit // 4 + 1, 4)
  # Gathered: the other processes' rows; else an all-reduce's 2 (P - 1) / P of the vector.
  assert reduction.received_bytes(100, 4) == 300
  assert reduction.received_bytes(limit, 4) == 2 * limit * 3 // 4
  assert reduction.received_bytes(100, 1) == 0
  # Past a few dozen processes no round is gathered: the scale figures are all-reduces.
  assert reduction.gathers(1, reduction.GATHERED_ROUND_PROCESSES)
  assert not reduction.gathers(1, reduction.GATHERED_ROUND_PROCESSES + 1)
