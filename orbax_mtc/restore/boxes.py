"""Box geometry of saved tiles: overlaps, volumes, and which tiles give a target shard's bytes.

Pure (no I/O or JAX); `elastic_plan` re-exports these names.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

Box = tuple[tuple[int, int], ...]  # a global index: ((start, stop), ...) per dimension


def intersect(a: Box, b: Box) -> Box | None:
  """The overlap of two boxes, or None."""
  out = []
  for (a0, a1), (b0, b1) in zip(a, b, strict=True):
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
      return None
    out.append((lo, hi))
  return tuple(out)


def volume(box: Box) -> int:
  """Elements in a box."""
  return math.prod(hi - lo for lo, hi in box)


class TileIndex(tuple):
  """A leaf's tiles (a tuple of boxes) with a lookup grid: `pieces` on it costs O(pieces
  found), not O(tiles). Build it once per leaf layout and pass it as `pieces`' `tiles`.

  The grid is used when the distinct tiles are the full product of disjoint, non-empty
  intervals per dimension (every saved sharding's tiles are); other tiles are scanned.
  """

  grid: _Grid | None

  def __new__(cls, tiles: Iterable[Box]) -> TileIndex:
    self = super().__new__(cls, tiles)
    self.grid = _Grid.build(self)
    return self


@dataclasses.dataclass(frozen=True)
class _Grid:
  """Per dimension the sorted interval starts and stops; per grid cell (mixed radix over the
  dimensions' interval ordinals) the index of the first tile with that box."""

  starts: tuple[list[int], ...]
  stops: tuple[list[int], ...]
  strides: tuple[int, ...]
  slots: list[int]

  @classmethod
  def build(cls, tiles: Sequence[Box]) -> _Grid | None:
    if not tiles or not tiles[0]:
      return None
    ndim = len(tiles[0])
    if any(len(box) != ndim for box in tiles):
      return None
    intervals = [sorted({box[d] for box in tiles}) for d in range(ndim)]
    for dim in intervals:
      if any(lo >= hi for lo, hi in dim):
        return None
      if any(b[0] < a[1] for a, b in zip(dim, dim[1:], strict=False)):
        return None  # overlapping intervals: not one sharding's grid
    cells = math.prod(len(dim) for dim in intervals)
    if cells > len(tiles):
      return None
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
      strides[d] = strides[d + 1] * len(intervals[d + 1])
    ordinal = [{interval: j * strides[d] for j, interval in enumerate(dim)}
               for d, dim in enumerate(intervals)]
    slots = [-1] * cells
    for i, box in enumerate(tiles):
      cell = sum(ordinal[d][box[d]] for d in range(ndim))
      if slots[cell] < 0:
        slots[cell] = i
    if min(slots) < 0:
      return None  # not the full product
    return cls(tuple([lo for lo, _ in dim] for dim in intervals),
               tuple([hi for _, hi in dim] for dim in intervals), tuple(strides), slots)

  def lookup(self, target: Box) -> list[int]:
    """Indices of the tiles whose intervals meet `target`'s in every dimension."""
    ranges = []
    for (lo, hi), starts, stops, stride in zip(target, self.starts, self.stops, self.strides,
                                               strict=True):
      first, end = bisect.bisect_right(stops, lo), bisect.bisect_left(starts, hi)
      if first >= end:
        return []
      ranges.append(range(first * stride, end * stride, stride))
    return [self.slots[sum(cell)] for cell in itertools.product(*ranges)]


def pieces(target: Box, tiles: Sequence[Box]) -> list[tuple[int, Box]]:
  """Which tiles give a target shard's bytes: (tile index, overlap), each element once.

  Tiles of one leaf are the distinct shard indices of its saved sharding: disjoint, covering
  the array. Identical tiles count once. O(tiles) per call, O(pieces found) on a `TileIndex`.

  Args:
    target: The target shard's global index.
    tiles: The leaf's tiles (a `TileIndex` for many targets over many tiles).

  Returns:
    (index into `tiles`, the overlap's global box), in tile order.

  Raises:
    ValueError: the tiles overlap each other inside the target, or leave part of it uncovered.
  """
  out: list[tuple[int, Box]] = []
  grid = tiles.grid if isinstance(tiles, TileIndex) else None
  if grid is not None and len(target) == len(grid.strides):
    for i in sorted(grid.lookup(target)):
      overlap = intersect(target, tiles[i])
      if overlap is not None:
        out.append((i, overlap))
  else:
    seen: set[Box] = set()
    for i, tile in enumerate(tiles):
      if tile in seen:
        continue
      seen.add(tile)
      overlap = intersect(target, tile)
      if overlap is not None:
        out.append((i, overlap))
  total = sum(volume(box) for _, box in out)
  if total != volume(target):
    raise ValueError(f"the saved tiles cover {total} of the {volume(target)} elements of "
                     f"target shard {target}: they overlap or leave a gap")
  if grid is None and _any_overlap([box for _, box in out]):
    raise ValueError(f"saved tiles overlap inside target shard {target}")
  return out


def _any_overlap(boxes: list[Box]) -> bool:
  """Whether two of the boxes overlap: sorted by their first dimension's start, each box is
  compared only with those starting before it ends there."""
  ordered = sorted(boxes)
  for i, a in enumerate(ordered):
    for b in ordered[i + 1:]:
      if b[0][0] >= a[0][1]:
        break
      if intersect(a, b) is not None:
        return True
  return False


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
  """`box` as slices into an array whose global index is `origin`."""
  return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))
