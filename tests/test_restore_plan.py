"""Pure restore planning: which step the cluster restores, and where each node gets its data."""

from __future__ import annotations

import pytest
from restore_plan_support import inv, own, peer

from orbax_mtc import step_listing as rp

pytestmark = pytest.mark.timeout(60)


def test_intersection_newest_first():
  inventories = [{2, 4, 6, 8}, {4, 6, 8, 10}, {6, 4, 12, 8}]
  assert rp.common_steps(inventories) == [8, 6, 4]
  plan = rp.plan_restore(inventories, persistent_steps=[], requested_step=None)
  assert plan.local_candidates == (8, 6, 4)
  assert plan.persistent_step is None
  assert not plan.empty
  for assembly in plan.candidates:
    assert assembly.sources == (own(0), own(1), own(2))
    assert assembly.transfers == () and assembly.recovered == ()


def test_one_process_missing_a_step_removes_it():
  inventories = [{4, 6}, {4}, {4, 6}]
  assert rp.plan_restore(inventories, [], None).local_candidates == (4,)


def test_plain_sets_have_no_twins_by_default():
  # Without shard groups every process is its own group, so nobody can stand in for another.
  assert rp.plan_restore([{4, 6}, {4}], [], None).local_candidates == (4,)
  # Plain sets and NodeInventory objects mix in one call.
  plan = rp.plan_restore([{4, 6}, {4}, inv({4, 6}, {(1, 6)})], [], None)
  assert plan.local_candidates == (6, 4)
  assert plan.candidates[0].sources == (own(0), peer(2), own(2))


def test_no_common_step_falls_back_to_newest_persistent():
  plan = rp.plan_restore([{6}, {8}], persistent_steps=[0, 4, 2], requested_step=None)
  assert plan.local_candidates == ()
  assert plan.persistent_step == 4
  assert not plan.empty


def test_local_then_persistent_when_both():
  plan = rp.plan_restore([{4, 6, 8}, {6, 8}], persistent_steps=[0, 4], requested_step=None)
  assert plan.local_candidates == (8, 6)
  assert plan.persistent_step == 4


def test_local_step_equal_to_persistent_is_kept():
  plan = rp.plan_restore([{4, 6}], persistent_steps=[4], requested_step=None)
  assert plan.local_candidates == (6, 4)
  assert plan.persistent_step == 4


def test_local_older_than_persistent_is_dropped():
  plan = rp.plan_restore([{2, 4, 6}, {2, 4, 6}], persistent_steps=[0, 5], requested_step=None)
  assert plan.local_candidates == (6,)
  assert plan.persistent_step == 5
  plan = rp.plan_restore([{2, 4}], persistent_steps=[8], requested_step=None)
  assert plan.local_candidates == ()
  assert plan.persistent_step == 8


def test_requested_step():
  inventories = [{4, 6, 8}, {4, 6, 8}]
  plan = rp.plan_restore(inventories, persistent_steps=[0, 4, 8], requested_step=6)
  assert plan.local_candidates == (6,)
  assert plan.persistent_step is None
  plan = rp.plan_restore(inventories, persistent_steps=[0, 4, 8], requested_step=4)
  assert plan.local_candidates == (4,)
  assert plan.persistent_step == 4
  plan = rp.plan_restore(inventories, persistent_steps=[0, 4, 8], requested_step=0)
  assert plan.local_candidates == ()
  assert plan.persistent_step == 0


def test_requested_step_held_by_only_some_processes():
  plan = rp.plan_restore([{4, 6}, {4}], persistent_steps=[6], requested_step=6)
  assert plan.local_candidates == ()
  assert plan.persistent_step == 6


def test_requested_step_nowhere_is_empty():
  plan = rp.plan_restore([{4, 6}], persistent_steps=[0, 4], requested_step=5)
  assert plan.empty
  assert plan.local_candidates == () and plan.persistent_step is None


@pytest.mark.parametrize("inventories", [[], [set()], [set(), set()], [{2}, set()]])
def test_empty(inventories):
  assert rp.common_steps(inventories) == []
  plan = rp.plan_restore(inventories, persistent_steps=[], requested_step=None)
  assert plan.empty
  assert plan.local_candidates == ()
  assert plan.persistent_step is None


def test_no_processes_with_persistent_steps():
  plan = rp.plan_restore([], persistent_steps=[3, 7], requested_step=None)
  assert plan.local_candidates == () and plan.persistent_step == 7
