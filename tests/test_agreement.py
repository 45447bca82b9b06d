"""The agreed records: one encode/decode per record, pure (numpy only)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbax_mtc import agreement
from orbax_mtc import step_listing as restore_plan
from orbax_mtc.agreement import Status

steps = st.lists(st.integers(0, 2**31 - 1), max_size=40)
pairs = st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 2**31 - 1)), max_size=40)
text = st.text(max_size=300)
big = st.integers(-(2**62), 2**62)


def _gather_all(records):
  """Every process's record as the others receive them: encode each, stack, decode."""
  rows = np.stack([agreement.encode(r) for r in records])
  return [agreement.decode(type(records[0]), row) for row in rows]


@settings(max_examples=200, deadline=None)
@given(own=steps, copies=pairs, persistent=steps, kind=st.text(max_size=60), message=text,
       backup_step=st.integers(-1, 2**40), step=big, clock=st.integers(0, 2**62),
       flags=st.lists(st.booleans(), min_size=4, max_size=4),
       state=st.sampled_from(list(Status)))
def test_save_record_round_trips(own, copies, persistent, kind, message, backup_step, step,
                                 clock, flags, state):
  record = agreement.SaveRecord(
      step=step, fault=agreement.Fault(kind=kind, message=message, backup_step=backup_step),
      inventory=agreement.Inventory.of(own, copies, persistent),
      has_step_in_ram=flags[0], has_step_persistent=flags[1], wants_backup=flags[2],
      backup_state=state, orbax_busy=flags[3], clock_ms=clock)
  (back,) = _gather_all([record])
  inv = back.inventory
  # Steps newest first, cut to the width; copies newest step first.
  assert inv.own_steps == tuple(sorted(set(own), reverse=True)[:32])
  assert inv.persistent_steps == tuple(sorted(set(persistent), reverse=True)[:32])
  assert inv.persistent_truncated == (len(set(persistent)) > 32)
  assert set(inv.copies) <= set(copies) and len(inv.copies) == min(32, len(set(copies)))
  assert (back.step, back.clock_ms, back.backup_state) == (step, clock, state)
  assert (back.has_step_in_ram, back.has_step_persistent, back.wants_backup,
          back.orbax_busy) == tuple(flags)
  assert back.fault.backup_step == backup_step
  assert message.encode().startswith(back.fault.message.encode())
  assert kind.encode().startswith(back.fault.kind.encode())
  assert isinstance(back.backup_state, Status)


def test_text_is_cut_on_a_character_boundary():
  message = "é" * 2000  # two bytes each: 4000 bytes, more than a fault message holds
  (back,) = _gather_all([agreement.BuildRecord(status=Status.UNUSABLE, message=message)])
  assert back.message and set(back.message) == {"é"}
  assert len(back.message.encode()) <= agreement._MESSAGE_BYTES


def test_every_slot_fits_in_int32_halves():
  """Rows travel as int32 halves; a value above 2**31 comes back whole."""
  record = agreement.SaveRecord(step=3, clock_ms=1_790_000_000_000)
  row = agreement.encode(record)
  halves = row.view(np.int32).astype(np.int32)
  assert agreement.decode(agreement.SaveRecord, halves.view(np.int64)) == record


def test_a_row_of_another_layout_is_refused():
  row = agreement.encode(agreement.FinishRecord())
  with pytest.raises(ValueError, match="different orbax-mtc versions"):
    agreement.decode(agreement.SaveRecord, row)


def test_faults_name_each_process_that_reports_one():
  records = [agreement.FinishRecord(),
             agreement.FinishRecord(fault=agreement.Fault.of(OSError(28, "No space left"))),
             agreement.FinishRecord(fault=agreement.Fault.of(ValueError("bad")))]
  assert {p: f"{f.kind}: {f.message}" for p, f in agreement.faults(records).items()} == {
      1: "OSError: [Errno 28] No space left", 2: "ValueError: bad"}

def test_agreed_persistent_steps_are_those_every_process_sees():
  inv = agreement.Inventory.of
  lagging = [inv([], [], [0, 4, 8]), inv([], [], [0, 4])]
  assert agreement.agreed_persistent_steps(lagging, [0, 4, 8]) == (0, 4)
  # A cut window: older steps come from this process's own view.
  many = list(range(0, 400, 10))
  cut = [inv([], [], many), inv([], [], many)]
  assert cut[0].persistent_truncated
  assert agreement.agreed_persistent_steps(cut, many) == tuple(many)


def test_restorable_steps_need_a_source_for_every_node():
  node = restore_plan.NodeInventory
  inventories = [node(frozenset({8, 9})), node(frozenset()),  # node 1 replaced
                 node(frozenset({8, 9}), frozenset({(1, 9)})), node(frozenset({8, 9}))]
  assert restore_plan.restorable_steps(inventories) == [9]
  # Twins (same shard group) serve each other's own folders.
  assert restore_plan.restorable_steps(inventories, [0, 1, 2, 1]) == [8, 9]


def test_retained_steps_follow_ram_retention():
  from orbax_mtc.save.retention import RamRetention

  assert RamRetention(2).kept([4, 6, 8, 10]) == {8, 10}
  assert RamRetention(2).kept([4, 6, 8, 10], 6) == {6, 8, 10}
  assert RamRetention(None).kept([4, 6]) == {4, 6}


def test_records_are_frozen_dataclasses_with_a_codec_per_field():
  for record_type in (agreement.StartRecord, agreement.SaveRecord, agreement.RestoreRecord,
                      agreement.BuildRecord, agreement.FinishRecord, agreement.ReadBackRecord,
                      agreement.OnDemandRecord, agreement.EntryRecord, agreement.SendRecord,
                      agreement.ServeRecord):
    assert dataclasses.is_dataclass(record_type)
    assert all("codec" in f.metadata for f in dataclasses.fields(record_type))
    default = record_type()
    assert agreement.decode(record_type, agreement.encode(default)) == default


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 6))
def test_restorable_steps_agree_with_the_planner(data, n):
  """The fast listing lists exactly the steps the planner can assemble."""
  step_set = st.frozensets(st.integers(0, 5), max_size=4)
  inventories = [restore_plan.NodeInventory(
      data.draw(step_set), data.draw(st.frozensets(
          st.tuples(st.integers(0, n - 1), st.integers(0, 5)), max_size=4)))
      for _ in range(n)]
  groups = data.draw(st.none() | st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
  expected = sorted(s for s in range(6)
                    if restore_plan.assemble(s, inventories, groups) is not None)
  assert restore_plan.restorable_steps(inventories, groups) == expected
