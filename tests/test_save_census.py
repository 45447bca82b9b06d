"""The save agreement by reduction (orbax_mtc.save_census) gives the answer the all-gather of
every process's SaveRecord gave, on randomized clusters (faults included), and its size per
process does not grow with the cluster. Pure: the reduction is reduction.combine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from orbax_mtc import agreement, reduction, save_census
from orbax_mtc import step_listing as listing
from orbax_mtc.agreement import Fault, Inventory, SaveRecord, Status
from orbax_mtc.reduction import Who


def simulate(records, groups=None, agreed=(), own_view=()):
  """Every process's answer, from the records alone (the reduction in numpy)."""
  count = len(records)

  def answer(me):
    return save_census.agree(
        records[me], me, count, groups, agreed, own_view,
        lambda rnd: reduction.combine(rnd.contribute(records[p], p) for p in range(count)))

  return [answer(me) for me in range(count)]


def old_decision(records, groups, own_view):
  """What the gathered rows decided (save/ram.py and ledger.py before the reduction)."""
  inventories = [r.inventory for r in records]
  nodes = [listing.NodeInventory(frozenset(i.own_steps), frozenset(i.copies))
           for i in inventories]
  newest = [max(i.own_steps) if i.own_steps else -1 for i in inventories]
  found = agreement.faults(records)
  local = {p: f for p, f in found.items() if f.backup_step < 0}
  backup = min(found.items()) if found and not local else None
  return dict(
      steps_differ=len({r.step for r in records}) > 1,
      ram=tuple(listing.restorable_steps(nodes, groups)),
      floor=min(newest) if len(records) > 1 and min(newest) >= 0 else None,
      persistent=agreement.agreed_persistent_steps(inventories, own_view),
      seen=agreement.persistent_steps_seen(inventories, own_view),
      local=local, backup=backup,
      in_ram=Who.of(r.has_step_in_ram for r in records),
      in_persistent=sum(r.has_step_persistent for r in records),
      wants_backup=any(r.wants_backup for r in records),
      busy=Who.of(r.orbax_busy for r in records),
      failed=Who.of(r.backup_state == Status.FAILED for r in records),
      all_ready=all(r.backup_state == Status.READY for r in records),
      clock_ms=records[0].clock_ms)


def new_decision(answer):
  c = answer.census
  return dict(
      steps_differ=answer.steps_error is not None, ram=answer.ram, floor=answer.floor,
      persistent=answer.persistent, seen=answer.persistent_seen,
      local=answer.local if answer.local_count <= save_census.NAMED_FAULTS else None,
      backup=answer.backup, in_ram=c.in_ram, in_persistent=c.in_persistent,
      wants_backup=c.wants_backup, busy=c.busy, failed=c.failed, all_ready=c.all_ready,
      clock_ms=c.clock_ms)


def random_cluster(rng: random.Random):
  count = rng.choice([1, 2, 3, 4, 6, 9])
  pool = sorted(rng.sample(range(0, 3_000_000_000, 100), 12))  # beyond 31 bits too
  step = rng.choice(pool)
  persistent = rng.sample(pool, rng.randint(0, 6))
  records = []
  for p in range(count):
    own = [s for s in pool[-5:] if rng.random() < 0.7]
    copies = [(rng.randrange(count + 1), s) for s in pool[-5:] if rng.random() < 0.4]
    seen = [s for s in persistent if rng.random() < 0.85]
    inv = Inventory.of(own, copies, seen)
    if rng.random() < 0.15:  # a cut persistent list
      inv = Inventory(inv.own_steps, inv.copies, inv.persistent_steps[:2], True)
    fault = Fault()
    if rng.random() < 0.2:
      fault = Fault(kind="OSError", message=f"disk {p} full",
                    backup_step=rng.choice([-1, -1, step]))
    records.append(SaveRecord(
        step=step if rng.random() < 0.9 else step + 100, fault=fault,
        inventory=agreement.decode(Inventory, agreement.encode(inv)),  # as the rows carried it
        has_step_in_ram=rng.random() < 0.3, has_step_persistent=rng.random() < 0.2,
        wants_backup=rng.random() < 0.2, backup_state=rng.choice(list(Status)),
        orbax_busy=rng.random() < 0.3, clock_ms=rng.randrange(2 ** 41)))
  groups = None if rng.random() < 0.5 else [rng.randrange(max(1, count // 2))
                                             for _ in range(count)]
  agreed = rng.sample(pool, rng.randint(0, len(pool)))  # slots seeded, or found
  own_view = rng.sample(pool, rng.randint(0, 4))
  return records, groups, agreed, own_view


@pytest.mark.parametrize("seed", range(300))
def test_the_reduced_answer_equals_the_gathered_one(seed):
  records, groups, agreed, own_view = random_cluster(random.Random(seed))
  answers = simulate(records, groups, agreed, own_view)
  old = old_decision(records, groups, own_view)
  for answer in answers:  # one answer on every process (rule 8)
    new = new_decision(answer)
    if new["local"] is None:  # more faults than travel: the named ones are the lowest
      lowest = sorted(old["local"])[:save_census.NAMED_FAULTS]
      assert answer.local == {p: old["local"][p] for p in lowest}
      new["local"] = old["local"]
    if old["steps_differ"]:  # raised before the faults are read
      new["local"], new["backup"] = old["local"], old["backup"]
    assert new == old
    assert answer.local_count == len(old["local"])


def test_processes_saving_different_steps_are_named_by_the_edges():
  records = [SaveRecord(step=s) for s in (4, 4, 5, 4)]
  (answer, *_) = simulate(records)
  assert answer.steps_error.startswith(
      "save() was called with different steps on different processes: "
      "process 0 and 2 other process(es): 4, process 2: 5")


def test_steps_outside_the_slots_are_found_by_their_buckets():
  # Nothing agreed yet, 300 distinct steps: the census runs again until each has a slot.
  records = [SaveRecord(step=7, inventory=Inventory.of(range(p, 300, 3), [], range(p, 90, 2)))
             for p in range(3)]
  answers = simulate(records)
  old = old_decision(records, None, ())
  assert answers[0].ram == old["ram"] == ()
  assert answers[0].persistent_seen == old["seen"] and answers[0].persistent == old["persistent"]
  assert len(answers[0].rounds) > 1 and not answers[0].census.unknown


def test_the_census_is_one_round_when_the_agreed_lists_name_every_step():
  records = [SaveRecord(step=30, inventory=Inventory.of([10, 20], [((p + 1) % 4, 20)], [10]))
             for p in range(4)]
  answer = simulate(records, agreed=[10, 20])[0]
  assert len(answer.rounds) == 1 and answer.ram == (10, 20) and answer.floor == 20
  assert answer.persistent == (10,)


def test_a_lost_node_is_covered_by_a_twin_or_a_copy_in_a_second_round():
  own = [[10, 20]] * 3 + [[]]  # node 3 lost its folder
  copies = [[], [], [(3, 20)], []]  # node 2 holds node 3's copy of 20
  records = [SaveRecord(step=30, inventory=Inventory.of(o, c, [])) for o, c in
             zip(own, copies, strict=True)]
  assert simulate(records, agreed=[10, 20])[0].ram == (20,)
  twins = simulate(records, groups=[0, 1, 0, 1], agreed=[10, 20])[0]
  assert twins.ram == (10, 20) and len(twins.rounds) == 2  # census, coverage


# --------------------------------------------------------------------------- size at scale


def census_bytes() -> int:
  """The first census's vectors in steady state: 8 agreed steps and the step saved."""
  record = SaveRecord(step=9000, inventory=Inventory.of([8000, 8500], [(1, 8500)], [8000]))
  shape = save_census.seed(range(1000, 9000, 1000), 9000)
  return save_census.census(record, 1, shape).nbytes


@pytest.mark.parametrize("processes, steady, lacking3", [
    (1_000, 1_135, 1_135 + 5_994), (10_000, 1_136, 1_136 + 59_994),
    (100_000, 1_136, 1_136 + 599_994)])
def test_the_save_agreement_size_per_process_is_pinned(processes, steady, lacking3):
  # A census: 4 x (21 + 5 x slots) bytes summed, 4 x (12 + 4 x 16 buckets) maxed, whatever
  # the process count; received by each process in a ring all-reduce: 2 x N x (P - 1) / P.
  slots = 9
  vector = 4 * (21 + 5 * slots) + 4 * (12 + 4 * save_census.FIRST_BUCKETS)
  assert census_bytes() == vector == save_census.census_bytes(slots) == 568
  assert save_census.bytes_per_process(processes, slots) == steady == \
      -(-2 * vector * (processes - 1) // processes)
  # While some nodes lack 3 steps (replaced nodes): one byte per node and step more.
  assert save_census.bytes_per_process(processes, slots, lacking=3) == lacking3 == \
      steady + -(-2 * 3 * processes * (processes - 1) // processes)
  assert lacking3 <= 1 << 20
  # The all-gather it replaces: one 2,424-byte SaveRecord row from every other process.
  before = reduction.gathered_bytes(8 * agreement.row_size(SaveRecord), processes)
  assert before == 2_424 * (processes - 1) and before > 100 * lacking3 / 3


def test_the_combined_bitmap_is_the_or_of_each_process_bit():
  words = [np.zeros(reduction.bitmap_words(70), np.int32) for _ in range(70)]
  for p in (0, 31, 32, 63, 69):
    reduction.pack_bit(words[p], p)
  total = reduction.combine(reduction.Parts(w, np.zeros(0, np.int32), np.zeros(0, np.uint8))
                            for w in words).add
  assert reduction.unpack_bits(total, 70).tolist() == [0, 31, 32, 63, 69]


def test_a_numpy_step_hashes_as_its_int():
  """Orbax's single-host load and broadcast lists numpy integers: the bucket's hash raised
  OverflowError on them (numpy does not wrap on the constants)."""
  shape = save_census.CensusShape(slots=(), salt=3)
  for step in (0, 7, 2**40):
    assert shape.bucket(np.int64(step)) == shape.bucket(step)
