"""Topology from a process grid: the grid itself, the errors that name the fix, and the peer options."""

from __future__ import annotations

import types
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from topology_support import build, check_invariants, check_rounds, edge_sets, layouts, max_degree

from orbax_mtc import topology as tp
from orbax_mtc.topology import TopologyError

pytestmark = pytest.mark.timeout(60)


def test_process_grid_reads_process_index():
  dev = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 2, 2, 3, 3)]
  mesh = types.SimpleNamespace(devices=np.array(dev, dtype=object).reshape(2, 4))
  grid = tp.process_grid(mesh)
  assert grid.shape == (2, 4)
  assert grid.dtype.kind == "i"
  np.testing.assert_array_equal(grid, [[0, 0, 1, 1], [2, 2, 3, 3]])
  topo = tp.build_topology(grid, ("data", "fsdp"), "data", num_processes=4)
  assert topo.replicas == ((0, 1), (2, 3))


def test_process_grid_real_jax_mesh():
  import jax
  from jax.sharding import Mesh

  devices = np.array(jax.devices()).reshape(1, -1)
  mesh = Mesh(devices, ("data", "fsdp"))
  grid = tp.process_grid(mesh)
  assert grid.shape == devices.shape
  assert (grid == jax.process_index()).all()
  topo = tp.build_topology(grid, mesh.axis_names, "data", num_processes=jax.process_count())
  assert topo.replicas == ((0,),)
  assert topo.peers == ((),)


def test_unknown_replica_axis_names_axis_and_suggests():
  with pytest.raises(TopologyError, match=r"'dat' is not an axis.*\['data', 'fsdp'\].*'data'"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), axis="dat")
  with pytest.raises(TopologyError, match=r"'replica'.*replica_axis='data'"):
    build([[0, 1, 2, 3]], ("diloco", "data"), axis="replica")
  with pytest.raises(TopologyError, match=r"replica_axis='x'"):
    build([[0], [1]], ("x", "y"), axis="zzz")


def test_replica_axis_splits_a_process():
  with pytest.raises(TopologyError,
                     match=r"splits process 0's devices across replicas \[0, 1\].*whole "
                           r"processes.*non-replica axis"):
    build([[0, 1], [0, 1]], ("data", "fsdp"))
  # One process with two data-parallel device groups: still a fraction of a process per replica.
  with pytest.raises(TopologyError, match="splits process 0"):
    build([[0], [0]], ("data", "fsdp"))
  # Process 1 straddles replicas 0 and 1.
  with pytest.raises(TopologyError, match=r"splits process 1's devices across replicas \[0, 1\]"):
    build([[0, 0, 1], [1, 2, 2]], ("data", "fsdp"))
  with pytest.raises(TopologyError, match=r"and 1 more processes"):
    build([[0, 1], [1, 0]], ("data", "fsdp"))


def test_rank_missing_from_grid():
  with pytest.raises(TopologyError, match=r"processes \[3\] own no device"):
    build([[0, 1], [2, 2]], ("data", "fsdp"), num_processes=4)


def test_rank_out_of_range():
  with pytest.raises(TopologyError, match=r"ranks \[4\] outside range\(num_processes=4\)"):
    build([[0, 1], [2, 4]], ("data", "fsdp"), num_processes=4)
  with pytest.raises(TopologyError, match=r"ranks \[-1\] outside"):
    build([[0, 1], [2, -1]], ("data", "fsdp"), num_processes=4)


def test_topology_does_not_divide():
  with pytest.raises(TopologyError, match=r"does not divide.*\[2, 1\] processes"):
    build([[0, 0, 1], [2, 2, 2]], ("data", "fsdp"), num_processes=3)


def test_bad_grid_or_names():
  with pytest.raises(TopologyError, match="integer array"):
    build(np.array([[0.0, 1.0]]), ("data", "fsdp"), num_processes=2)
  with pytest.raises(TopologyError, match=r"grid has 2 axes .* names 1"):
    build([[0, 1]], ("data",))
  with pytest.raises(TopologyError, match="repeat a name"):
    build([[0, 1]], ("data", "data"))
  with pytest.raises(TopologyError, match="sequence of axis names"):
    build([[0, 1]], "data")
  with pytest.raises(TopologyError, match="no devices"):
    build(np.zeros((0, 2), dtype=int), ("data", "fsdp"), num_processes=1)
  with pytest.raises(TopologyError, match="num_processes must be a positive int"):
    build([[0]], ("data", "fsdp"), num_processes=0)


def test_peer_options_mutually_exclusive():
  with pytest.raises(TopologyError, match="mutually exclusive"):
    build([[0, 1]], ("data", "fsdp"), peers_per_node=1, peer_ranks=[[1], [0]])


def test_more_peers_than_nodes():
  with pytest.raises(TopologyError, match=r"more peers than nodes.*peers_per_node=4.*4 nodes"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=4)
  with pytest.raises(TopologyError, match="more peers than nodes"):
    build([[0]], ("data", "fsdp"), peers_per_node=1)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_peers_per_node_must_be_int(bad):
  with pytest.raises(TopologyError, match="peers_per_node must be an int"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=bad)


@pytest.mark.parametrize(("peer_ranks", "pattern"), [
    ([[1], [0], [0]], r"3 lists but there are 2 nodes"),
    ([[1]], r"1 lists but there are 2 nodes"),
    ([[2], [0]], r"node 0 has peer 2, which is not a rank in 0..1"),
    ([[1], [-1]], r"node 1 has peer -1"),
    ([[1], ["0"]], r"node 1 has peer '0'"),
    ([[1], [True]], r"node 1 has peer True"),
    ([[0], [0]], r"node 0 lists itself"),
    ([[1, 1], [0]], r"node 0 lists peer 1 more than once"),
    ([1, [0]], r"peer_ranks\[0\] = 1 is not a list"),
])
def test_bad_peer_ranks(peer_ranks, pattern):
  with pytest.raises(TopologyError, match=pattern):
    build([[0, 1]], ("data", "fsdp"), peer_ranks=peer_ranks)


def test_held_by_out_of_range():
  topo = build([[0, 1]], ("data", "fsdp"))
  with pytest.raises(TopologyError, match="rank 2 is not a process rank"):
    topo.held_by(2)


def test_default_peers_rejects_bad_replicas():
  with pytest.raises(TopologyError, match="does not divide"):
    tp.default_peers([(0, 1), (2,)], 1)
  with pytest.raises(TopologyError, match="does not divide"):
    tp.default_peers([], 1)
  with pytest.raises(TopologyError, match="exactly once"):
    tp.default_peers([(0, 1), (1, 3)], 1)


def test_errors_are_value_errors():
  assert issubclass(TopologyError, ValueError)


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data())
def test_property_build_topology(layout, data):
  grid, names, replicas = layout
  num_replicas, n = len(replicas), len(replicas[0])
  num = num_replicas * n
  k = data.draw(st.integers(0, num - 1), label="peers_per_node")
  topo = tp.build_topology(grid, names, "data", num_processes=num, peers_per_node=k)
  check_invariants(topo)
  assert topo.replicas == replicas
  assert topo.peers == tp.default_peers(replicas, k)
  for r, ranks in enumerate(replicas):
    for i, rank in enumerate(ranks):
      assert topo.replica_of[rank] == r
      assert topo.position_of[rank] == i
      assert topo.twins[rank] == tuple(replicas[o][i] for o in range(num_replicas) if o != r)
  gives = Counter(s for s, _ in topo.edges)
  holds = Counter(h for _, h in topo.edges)
  for rank in range(num):
    assert len(topo.peers[rank]) == k
    assert gives[rank] == k
    assert holds[rank] == k
    assert len(topo.held_by(rank)) == k
    if k >= 1 and num_replicas > 1:
      first = topo.peers[rank][0]
      assert topo.replica_of[first] != topo.replica_of[rank]
      assert first in topo.twins[rank]
      assert first == replicas[(topo.replica_of[rank] + 1) % num_replicas][topo.position_of[rank]]
    if k >= num_replicas - 1:
      assert set(topo.peers[rank][:num_replicas - 1]) == set(topo.twins[rank])
  if k == num - 1:
    assert all(set(p) | {r} == set(range(num)) for r, p in enumerate(topo.peers))
  rounds = tp.transfer_rounds(topo.edges)
  assert len(rounds) == k


@settings(max_examples=100, deadline=None)
@given(layout=layouts())
def test_property_default_is_one_peer(layout):
  grid, names, replicas = layout
  num = sum(len(r) for r in replicas)
  topo = tp.build_topology(grid, names, "data", num_processes=num)
  assert all(len(p) == (1 if num > 1 else 0) for p in topo.peers)


@settings(max_examples=100, deadline=None)
@given(num_replicas=st.integers(1, 6), n=st.integers(1, 6), data=st.data())
def test_property_default_peers(num_replicas, n, data):
  num = num_replicas * n
  perm = data.draw(st.permutations(range(num)), label="numbering")
  replicas = [perm[r * n:(r + 1) * n] for r in range(num_replicas)]
  k = data.draw(st.integers(0, num - 1), label="k")
  peers = tp.default_peers(replicas, k)
  assert len(peers) == num
  held = Counter(h for p in peers for h in p)
  for rank, p in enumerate(peers):
    assert len(p) == k
    assert rank not in p
    assert len(set(p)) == k
    assert held[rank] == k
  # Preference order is a prefix: k peers are the first k of k + 1.
  if k < num - 1:
    more = tp.default_peers(replicas, k + 1)
    assert all(m[:k] == p for m, p in zip(more, peers, strict=True))
  with pytest.raises(TopologyError, match="more peers than nodes"):
    tp.default_peers(replicas, num)


@settings(max_examples=100, deadline=None)
@given(num=st.integers(1, 8), data=st.data())
def test_property_explicit_peer_ranks(num, data):
  peer_ranks = [
      data.draw(st.lists(st.sampled_from([r for r in range(num) if r != node] or [0]),
                         unique=True, max_size=num - 1), label=f"peers of {node}")
      for node in range(num)
  ]
  grid = np.arange(num).reshape(1, num)
  topo = tp.build_topology(grid, ("data", "fsdp"), "data", num_processes=num,
                           peer_ranks=peer_ranks)
  assert topo.peers == tuple(tuple(p) for p in peer_ranks)
  check_invariants(topo)


@settings(max_examples=300, deadline=None)
@given(edges=edge_sets, data=st.data())
def test_property_transfer_rounds(edges, data):
  edges = sorted(edges)
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) <= 2 * max_degree(edges)  # greedy bound
  assert len(rounds) == max_degree(edges)  # in fact optimal (bipartite edge colouring)
  shuffled = data.draw(st.permutations(edges), label="shuffled")
  assert tp.transfer_rounds(shuffled) == rounds
  assert tp.transfer_rounds(tuple(shuffled)) == rounds


@settings(max_examples=100, deadline=None)
@given(num_replicas=st.integers(1, 6), n=st.integers(1, 6), data=st.data())
def test_property_default_peer_edges_take_k_rounds(num_replicas, n, data):
  num = num_replicas * n
  k = data.draw(st.integers(0, num - 1), label="k")
  replicas = [range(r * n, (r + 1) * n) for r in range(num_replicas)]
  edges = [(s, h) for s, p in enumerate(tp.default_peers(replicas, k)) for h in p]
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) == k


def test_transfer_rounds_examples():
  assert tp.transfer_rounds([]) == []
  assert tp.transfer_rounds([(0, 1)]) == [((0, 1),)]
  # A ring is one round: everyone sends once and receives once.
  assert tp.transfer_rounds([(3, 0), (0, 1), (2, 3), (1, 2)]) == [((0, 1), (1, 2), (2, 3), (3, 0))]
  # A fan-out from one rank takes one round per destination.
  assert tp.transfer_rounds([(0, 3), (0, 1), (0, 2)]) == [((0, 1),), ((0, 2),), ((0, 3),)]
  # A rank may send and receive in the same round.
  assert tp.transfer_rounds([(0, 1), (1, 0)]) == [((0, 1), (1, 0))]
  # numpy ints come back as ints.
  out = tp.transfer_rounds(np.array([[0, 1], [1, 2]]).tolist())
  assert out == [((0, 1), (1, 2))]
  out = tp.transfer_rounds([(np.int64(0), np.int32(1))])
  assert out == [((0, 1),)] and type(out[0][0][0]) is int


def test_transfer_rounds_needs_path_swap():
  # Greedy first-fit colouring would need 3 rounds here; max degree is 2.
  edges = [(1, 2), (0, 2), (1, 0), (0, 1)]
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) == 2


def test_transfer_rounds_errors():
  with pytest.raises(TopologyError, match="to itself"):
    tp.transfer_rounds([(0, 1), (2, 2)])
  with pytest.raises(ValueError, match="more than once"):
    tp.transfer_rounds([(0, 1), (1, 2), (0, 1)])
  with pytest.raises(ValueError, match="not a .source, destination. pair"):
    tp.transfer_rounds([(0, 1, 2)])
  with pytest.raises(ValueError, match="ints >= 0"):
    tp.transfer_rounds([(0, -1)])
  with pytest.raises(ValueError, match="ints >= 0"):
    tp.transfer_rounds([(0, 1.5)])
