"""Helpers and fixtures shared by test_topology.py and test_topology_grid.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import strategies as st

from orbax_mtc import topology as tp


def build(grid, names, axis="data", num_processes=None, **kw):
  grid = np.asarray(grid)
  if num_processes is None:
    num_processes = int(grid.max()) + 1
  return tp.build_topology(grid, names, axis, num_processes=num_processes, **kw)


def check_invariants(topo: tp.Topology) -> None:
  """Properties every valid topology has, whatever the mesh."""
  n = topo.num_processes
  assert sorted(r for ranks in topo.replicas for r in ranks) == list(range(n))
  assert len({len(ranks) for ranks in topo.replicas}) == 1
  for rank in range(n):
    assert topo.replicas[topo.replica_of[rank]][topo.position_of[rank]] == rank
    assert len(topo.twins[rank]) == len(topo.replicas) - 1
    for twin in topo.twins[rank]:
      assert topo.position_of[twin] == topo.position_of[rank]
      assert topo.replica_of[twin] != topo.replica_of[rank]
    assert [topo.replica_of[t] for t in topo.twins[rank]] == sorted(
        topo.replica_of[t] for t in topo.twins[rank])
    assert rank not in topo.peers[rank]
    assert len(set(topo.peers[rank])) == len(topo.peers[rank])
  assert topo.edges == tuple(sorted(topo.edges))
  assert len(topo.edges) == sum(len(p) for p in topo.peers)
  for rank in range(n):
    assert topo.held_by(rank) == tuple(s for s, h in topo.edges if h == rank)


@st.composite
def layouts(draw):
  """A mesh of R replicas x n processes x d devices each, in random axis order and numbering."""
  num_replicas = draw(st.integers(1, 5))
  n = draw(st.integers(1, 5))
  d = draw(st.integers(1, 3))
  perm = draw(st.permutations(range(num_replicas * n)))
  replicas = tuple(tuple(perm[r * n:(r + 1) * n]) for r in range(num_replicas))
  grid = np.array([[replicas[r][c // d] for c in range(n * d)] for r in range(num_replicas)])
  names = ["data", "fsdp"]
  if draw(st.booleans()):  # host devices on an axis of their own
    grid = grid.reshape(num_replicas, n, d)
    names = ["data", "fsdp", "tensor"]
  for j in range(draw(st.integers(0, 2))):  # size-1 axes (diloco, stage, ...)
    grid = grid[np.newaxis]
    names.insert(0, f"extra{j}")
  pos = draw(st.integers(0, grid.ndim - 1))
  grid = np.moveaxis(grid, names.index("data"), pos)
  names.remove("data")
  names.insert(pos, "data")
  return grid, tuple(names), replicas


def max_degree(edges) -> int:
  return max([*Counter(s for s, _ in edges).values(), *Counter(d for _, d in edges).values()],
             default=0)


def check_rounds(edges, rounds) -> None:
  flat = [e for r in rounds for e in r]
  assert sorted(flat) == sorted(edges)  # every edge exactly once
  for r in rounds:
    assert r  # no empty rounds
    assert r == tuple(sorted(r))
    assert len({s for s, _ in r}) == len(r)  # each rank sends at most once
    assert len({d for _, d in r}) == len(r)  # each rank receives at most once


edge_sets = st.sets(
    st.tuples(st.integers(0, 9), st.integers(0, 9)).filter(lambda e: e[0] != e[1]), max_size=45)
