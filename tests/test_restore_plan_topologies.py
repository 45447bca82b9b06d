"""Pure restore planning on concrete topologies: which node serves each rank after wipes, lost replicas and slices, excluded sources."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from restore_plan_support import (
  DATA2_FSDP2,
  FSDP4,
  MAX_STEP,
  RING,
  STEPS,
  TWIN_COPIES,
  Cluster,
  check_source,
  clusters,
  full_cluster,
  inv,
  own,
  peer,
  plan_of,
  twin,
  valid_holders,
  wipe,
)

from orbax_mtc import step_listing as rp

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("copies", [{}, TWIN_COPIES], ids=["no-copies", "twin-copies"])
def test_data2_fsdp2_one_node_wiped_restores_from_twin(copies):
  invs = wipe(full_cluster(DATA2_FSDP2, copies), 0)
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == (20, 10)
  for assembly in plan.candidates:
    assert assembly.sources == (twin(2), own(1), own(2), own(3))
    assert assembly.transfers == ((2, 0, rp.TWIN),)
    assert assembly.recovered == (0,)


def test_data2_fsdp2_whole_replica_lost():
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), 0, 1)
  plan = rp.plan_restore(invs, [0], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == (20, 10)
  assert plan.persistent_step == 0
  assert plan.candidates[0].sources == (twin(2), twin(3), own(2), own(3))
  assert plan.candidates[0].transfers == ((2, 0, rp.TWIN), (3, 1, rp.TWIN))
  # The other replica lost instead: symmetric.
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), 2, 3)
  plan = rp.plan_restore(invs, [0], None, shard_groups=DATA2_FSDP2)
  assert plan.candidates[0].sources == (own(0), own(1), twin(0), twin(1))


def test_data2_fsdp2_both_twins_lost_falls_back_to_persistent():
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), 0, 2)
  plan = rp.plan_restore(invs, [0, 10], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == ()
  assert plan.persistent_step == 10
  assert rp.assemble(20, invs, DATA2_FSDP2) is None


def test_fsdp4_ring_one_node_wiped_restores_from_peer():
  invs = wipe(full_cluster(FSDP4, RING), 1)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4)
  assert plan.local_candidates == (20, 10)
  for assembly in plan.candidates:
    assert assembly.sources == (own(0), peer(2), own(2), own(3))
    assert assembly.transfers == ((2, 1, rp.PEER),)


def test_fsdp4_ring_without_shard_groups_is_the_same():
  invs = wipe(full_cluster(FSDP4, RING), 1)
  assert rp.plan_restore(invs, [], None) == rp.plan_restore(invs, [], None, shard_groups=FSDP4)


def test_fsdp4_node_and_its_only_peer_wiped():
  invs = wipe(full_cluster(FSDP4, RING), 1, 2)
  assert rp.assemble(20, invs, FSDP4) is None
  assert rp.assemble(10, invs, FSDP4) is None
  plan = rp.plan_restore(invs, [0], None, shard_groups=FSDP4)
  assert plan.local_candidates == () and plan.persistent_step == 0
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4)
  assert plan.empty


def test_fsdp4_node_and_its_peer_lost_newest_but_older_step_survives():
  # Node 2 is wiped; node 1 lost only step 20 (so node 2's copy of it is gone too).
  invs = full_cluster(FSDP4, RING)
  invs[2] = inv()
  invs[1] = inv({10}, invs[1].copies)
  plan = rp.plan_restore(invs, [0], None, shard_groups=FSDP4)
  assert plan.local_candidates == (10,)
  assert plan.candidates[0].sources == (own(0), own(1), peer(3), own(3))
  assert plan.persistent_step == 0


@pytest.mark.parametrize("lost", [(0, 1), (2, 3)], ids=["slice0", "slice1"])
def test_two_slices_data_parallel_one_slice_lost(lost):
  # 2 slices x 2 hosts, one data replica per slice (assume-data-parallelism = 2): twins = peers.
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), *lost)
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2)
  expected = [own(r) for r in range(4)]
  for r in lost:
    expected[r] = twin((r + 2) % 4)
  assert plan.candidates[0].sources == tuple(expected)


@pytest.mark.parametrize("lost", [(0, 1), (2, 3)], ids=["slice0", "slice1"])
def test_two_slices_fsdp_across_slices_one_slice_lost(lost):
  # 2 slices x 2 hosts, one replica spread over both slices: peers are at the same index in the
  # other slice and hold copies, nobody has a twin.
  invs = wipe(full_cluster(FSDP4, TWIN_COPIES), *lost)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4)
  expected = [own(r) for r in range(4)]
  for r in lost:
    expected[r] = peer((r + 2) % 4)
  assert plan.local_candidates == (20, 10)
  assert plan.candidates[0].sources == tuple(expected)


def test_two_slices_fsdp_across_slices_node_and_peer_lost():
  invs = wipe(full_cluster(FSDP4, TWIN_COPIES), 1, 3)
  plan = rp.plan_restore(invs, [10], None, shard_groups=FSDP4)
  assert plan.local_candidates == () and plan.persistent_step == 10


def test_two_slices_data_parallel_failed_read_from_twin():
  # Node 0 wiped and the read from node 2 failed for node 0 at step 20: node 2 is its only twin
  # and its only peer holder, so step 20 is out and step 10 is restored.
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), 0)
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2, excluded={(2, 0, 20)})
  assert plan.local_candidates == (10,)
  # Node 0 is not wiped but its own step 20 is corrupt: twin 2 serves it, even though 2 also
  # holds a copy of node 0 (twin before peer).
  invs = full_cluster(DATA2_FSDP2, TWIN_COPIES)
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2, excluded={(0, 0, 20)})
  assert plan.candidates[0].sources == (twin(2), own(1), own(2), own(3))
  assert plan.candidates[1].sources == (own(0), own(1), own(2), own(3))


def test_two_slices_no_twin_own_folder_corrupt_uses_peer_copy():
  # Node 2's own folder at step 20 is corrupt; with no twins it reads the copy node 0 holds.
  invs = full_cluster(DATA2_FSDP2, TWIN_COPIES)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4, excluded={(2, 2, 20)})
  assert plan.candidates[0].sources == (own(0), own(1), peer(0), own(3))
  # With twins, node 2's twin is node 0 too, and the twin read comes first.
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2, excluded={(2, 2, 20)})
  assert plan.candidates[0].sources == (own(0), own(1), twin(0), own(3))


def test_corrupt_copy_is_skipped_for_another_holder():
  # Two peers per node: node 1's data is copied on nodes 2 and 3.
  holders = {2: [1], 3: [1]}
  invs = wipe(full_cluster(FSDP4, holders), 1)
  assert rp.assemble(20, invs, FSDP4).sources[1] == peer(2)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4, excluded=[(2, 1, 20)])
  assert plan.candidates[0].step == 20
  assert plan.candidates[0].sources[1] == peer(3)
  # The exclusion is for step 20 only.
  assert plan.candidates[1].step == 10 and plan.candidates[1].sources[1] == peer(2)


def test_only_copy_corrupt_drops_the_step():
  invs = wipe(full_cluster(FSDP4, RING), 1)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4, excluded={(2, 1, 20)})
  assert plan.local_candidates == (10,)
  assert plan.candidates[0].sources == (own(0), peer(2), own(2), own(3))
  plan = rp.plan_restore(invs, [0], None, shard_groups=FSDP4,
                         excluded={(2, 1, 20), (2, 1, 10)})
  assert plan.local_candidates == () and plan.persistent_step == 0


def test_corrupt_own_folder_sources_from_peer():
  invs = full_cluster(FSDP4, RING)
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4, excluded={(3, 3, 20)})
  assert plan.candidates[0].sources == (own(0), own(1), own(2), peer(0))
  assert plan.candidates[1].sources == tuple(own(r) for r in range(4))


def test_corrupt_own_folder_is_not_served_as_a_twin_either():
  # Node 0 is wiped; twin 2's own folder is corrupt, so it can neither restore itself from it
  # nor send it to node 0. Node 2 can still send the copy of node 0 it holds.
  invs = full_cluster([0, 0, 0], {2: [0]})
  invs[0] = inv()
  assert rp.assemble(20, invs, [0, 0, 0], excluded={(2, 2, 20)}).sources == \
      (twin(1), own(1), twin(1))
  assert rp.assemble(20, invs, [0, 0, 0], excluded={(2, 2, 20), (1, 0, 20)}).sources == \
      (peer(2), own(1), twin(1))
  assert rp.assemble(20, invs, [0, 0, 0], excluded={(1, 1, 20), (2, 2, 20)}) is None


def test_exclusion_of_another_destination_does_not_matter():
  invs = wipe(full_cluster(DATA2_FSDP2, {}), 0)
  plan = rp.plan_restore(invs, [], None, shard_groups=DATA2_FSDP2, excluded={(2, 1, 20)})
  assert plan.candidates[0].sources == (twin(2), own(1), own(2), own(3))


def test_senders_are_spread_over_twins():
  groups = [0] * 6
  invs = [inv(), inv(), inv(), inv(), inv(STEPS), inv(STEPS)]
  assembly = rp.assemble(20, invs, groups)
  assert assembly.sources == (twin(4), twin(5), twin(4), twin(5), own(4), own(5))


def test_tie_goes_to_the_lowest_rank():
  invs = [inv(), inv(STEPS), inv(STEPS), inv(STEPS)]
  assert rp.assemble(20, invs, [0, 0, 0, 0]).sources == (twin(1), own(1), own(2), own(3))
  invs = [inv(STEPS), inv(STEPS), inv(STEPS), inv()]
  assert rp.assemble(20, invs, [0, 0, 0, 0]).sources == (own(0), own(1), own(2), twin(0))


def test_twin_preferred_over_a_less_loaded_peer():
  invs = [inv(), inv(STEPS), inv(STEPS, {(0, 20)})]
  assert rp.assemble(20, invs, [0, 0, 1]).sources == (twin(1), own(1), own(2))


def test_load_counts_peer_and_twin_transfers_together():
  # Node 0 gets a peer copy from node 1; node 2 then prefers twin 3 over the busier twin 1.
  invs = [inv(), inv(STEPS, {(0, 20)}), inv(), inv(STEPS)]
  assert rp.assemble(20, invs, [0, 1, 1, 1]).sources == (peer(1), own(1), twin(3), own(3))


def test_peer_copies_spread_over_holders():
  invs = [inv(), inv(), inv(STEPS, {(0, 20), (1, 20)}), inv(STEPS, {(0, 20), (1, 20)})]
  assert rp.assemble(20, invs, FSDP4).sources == (peer(2), peer(3), own(2), own(3))


def test_plan_is_deterministic():
  invs = wipe(full_cluster([0, 0, 0, 0], RING), 0, 1)
  shuffled = [inv(sorted(i.own_steps, reverse=True), sorted(i.copies, reverse=True))
              for i in invs]
  kwargs = dict(shard_groups=[0, 0, 0, 0], excluded=[(2, 0, 20), (3, 1, 10)])
  first = rp.plan_restore(invs, [5, 0], None, **kwargs)
  assert first == rp.plan_restore(invs, [0, 5], None, **kwargs)
  assert first == rp.plan_restore(shuffled, (0, 5), None, shard_groups=(0, 0, 0, 0),
                                  excluded={(3, 1, 10), (2, 0, 20)})
  assert first.candidates[0].sources == (twin(3), twin(2), own(2), own(3))
  assert first.candidates[1].sources == (twin(2), twin(2), own(2), own(3))


def test_shard_groups_must_match_process_count():
  with pytest.raises(ValueError, match="3 shard groups for 2 inventories"):
    rp.plan_restore([{1}, {1}], [], None, shard_groups=[0, 0, 0])
  with pytest.raises(ValueError):
    rp.assemble(1, [inv({1})], [0, 1])


def test_requested_step_with_twins_and_peers():
  invs = wipe(full_cluster(FSDP4, RING), 1)
  plan = rp.plan_restore(invs, [0, 10, 20], 10, shard_groups=FSDP4)
  assert plan.local_candidates == (10,)
  assert plan.candidates[0].sources == (own(0), peer(2), own(2), own(3))
  assert plan.persistent_step == 10
  plan = rp.plan_restore(invs, [0], 15, shard_groups=FSDP4)
  assert plan.empty


def test_persistent_newer_than_ram_steps():
  invs = wipe(full_cluster(DATA2_FSDP2, TWIN_COPIES), 0)
  plan = rp.plan_restore(invs, [15], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == (20,) and plan.persistent_step == 15
  plan = rp.plan_restore(invs, [20], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == (20,) and plan.persistent_step == 20
  plan = rp.plan_restore(invs, [30, 10], None, shard_groups=DATA2_FSDP2)
  assert plan.local_candidates == () and plan.persistent_step == 30


def test_copy_only_steps_are_candidates():
  # Nobody owns step 7 any more, but every node's copy of it survives on its ring peer.
  invs = [inv((), {(3, 7)}), inv((), {(0, 7)}), inv((), {(1, 7)}), inv((), {(2, 7)})]
  plan = rp.plan_restore(invs, [], None, shard_groups=FSDP4)
  assert plan.local_candidates == (7,)
  assert plan.candidates[0].sources == (peer(1), peer(2), peer(3), peer(0))


def test_copy_of_its_own_data_on_the_same_node_is_not_a_source():
  invs = [inv((), {(0, 3)}), inv({3})]
  assert rp.plan_restore(invs, [], None).local_candidates == ()


def test_copy_of_rank_outside_the_cluster_is_ignored():
  invs = [inv({3}, {(9, 5)}), inv({3, 5})]
  assert rp.plan_restore(invs, [], None).local_candidates == (3,)


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_every_source_is_valid_and_best(c: Cluster):
  plan = plan_of(c)
  for assembly in plan.candidates:
    assert len(assembly.sources) == len(c.inventories)
    load = [0] * len(c.inventories)
    for dest, src in enumerate(assembly.sources):
      check_source(c, assembly.step, dest, src)
      holders = valid_holders(c, assembly.step, dest)
      # Own before twin before peer.
      best_kind = next(k for k in (rp.OWN, rp.TWIN, rp.PEER) if holders[k])
      assert src.kind == best_kind
      # Among holders of that kind: fewest transfers so far, then lowest rank.
      if src.kind != rp.OWN:
        assert src.holder == min(holders[src.kind], key=lambda h: (load[h], h))
        load[src.holder] += 1
    assert assembly.transfers == tuple((s.holder, d, s.kind)
                                       for d, s in enumerate(assembly.sources) if s.kind != rp.OWN)
    assert assembly.recovered == tuple(d for _, d, _ in assembly.transfers)


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_candidates_are_exactly_the_assemblable_steps(c: Cluster):
  plan = plan_of(c)
  steps = plan.local_candidates
  assert list(steps) == sorted(set(steps), reverse=True)  # strictly newest first
  persistent = [s for s in c.persistent if c.requested is None or s == c.requested]
  expected_persistent = max(persistent) if persistent else None
  assert plan.persistent_step == expected_persistent
  expected = []
  for step in range(MAX_STEP, -1, -1):
    if c.requested is not None and step != c.requested:
      continue
    if expected_persistent is not None and step < expected_persistent:
      continue
    n = len(c.inventories)
    if all(any(valid_holders(c, step, d).values()) for d in range(n)):
      expected.append(step)
  assert steps == tuple(expected)
  for assembly in plan.candidates:
    assert expected_persistent is None or assembly.step >= expected_persistent
    assert rp.assemble(assembly.step, c.inventories, c.groups, c.excluded) == assembly
  assert plan.empty == (not expected and expected_persistent is None)


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_plan_is_deterministic_and_order_independent(c: Cluster):
  plan = plan_of(c)
  assert plan == plan_of(c)
  rebuilt = [inv(sorted(i.own_steps, reverse=True), sorted(i.copies, reverse=True))
             for i in c.inventories]
  again = rp.plan_restore(rebuilt, sorted(c.persistent, reverse=True), c.requested,
                          shard_groups=tuple(c.groups), excluded=sorted(c.excluded))
  assert again == plan


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_plain_sets_mean_own_steps_only(c: Cluster):
  own_only = [inv(i.own_steps) for i in c.inventories]
  as_sets = [set(i.own_steps) for i in c.inventories]
  assert rp.plan_restore(as_sets, c.persistent, c.requested, shard_groups=c.groups,
                         excluded=c.excluded) == \
      rp.plan_restore(own_only, c.persistent, c.requested, shard_groups=c.groups,
                      excluded=c.excluded)
