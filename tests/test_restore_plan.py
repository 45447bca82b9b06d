"""Pure restore planning: which step the cluster restores, and from which tier."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_mtc import restore_plan as rp

pytestmark = pytest.mark.timeout(30)


def test_intersection_newest_first():
  inventories = [{2, 4, 6, 8}, {4, 6, 8, 10}, {6, 4, 12, 8}]
  assert rp.common_steps(inventories) == [8, 6, 4]
  plan = rp.plan_restore(inventories, persistent_steps=[], requested_step=None)
  assert plan.local_candidates == (8, 6, 4)
  assert plan.persistent_step is None
  assert not plan.empty


def test_one_process_missing_a_step_removes_it():
  inventories = [{4, 6}, {4}, {4, 6}]
  assert rp.plan_restore(inventories, [], None).local_candidates == (4,)


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


def test_encode_pads_and_sorts_newest_first():
  row = rp.encode_inventory([4, 2, 8, 4], width=6)
  assert row.dtype == np.int64
  assert row.shape == (6,)
  assert row.tolist() == [8, 4, 2, -1, -1, -1]
  assert rp.encode_inventory([], width=3).tolist() == [-1, -1, -1]
  assert rp.encode_inventory([1, 2]).shape == (rp.INVENTORY_WIDTH,)


def test_inventory_round_trip_several_processes():
  inventories = [{0, 2, 4}, set(), {10**12, 3}]
  rows = np.stack([rp.encode_inventory(s, width=5) for s in inventories])
  assert rp.decode_inventories(rows) == inventories
  # A single row (one process) decodes to one inventory.
  assert rp.decode_inventories(rp.encode_inventory({7, 9}, width=4)) == [{7, 9}]
  # What a gather of one process returns: shape (1, width).
  assert rp.decode_inventories(rp.encode_inventory({0}, width=4)[None]) == [{0}]


def test_more_steps_than_width_keeps_the_newest():
  steps = list(range(0, 200, 2))
  row = rp.encode_inventory(steps, width=8)
  assert row.tolist() == sorted(steps, reverse=True)[:8]
  (decoded,) = rp.decode_inventories(row[None])
  assert decoded == set(range(184, 200, 2))
  # Older steps beyond the width are simply not candidates.
  plan = rp.plan_restore([decoded, set(steps)], persistent_steps=[], requested_step=None)
  assert plan.local_candidates == tuple(range(198, 183, -2))
