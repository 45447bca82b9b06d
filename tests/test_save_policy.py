"""Pure save decisions (orbax_mtc.save.policy): plain numbers in, a decision out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc.options import LocalCheckpointOptions, PersistentCheckpointOptions
from orbax_mtc.save import policy as save_policy
from orbax_mtc.save.policy import SaveAction, SaveDecision


def _never() -> bool:
  raise AssertionError("this schedule must not be asked")


def _decide(step: int, *, force=False, preempted=False, read_only=False, managed=False,
            ram=(), persistent=(), ondemand_step=None,
            ram_due: Callable[[], bool] = lambda: False,
            persistent_due: Callable[[], bool] = lambda: False) -> SaveDecision:
  return save_policy.decide_save(
      step, force=force, preempted=preempted, read_only=read_only, managed=managed,
      agreed_ram=ram, agreed_persistent=persistent, ondemand_step=ondemand_step,
      ram_due=ram_due, persistent_due=persistent_due)


def test_nothing_due_skips():
  assert _decide(3) == SaveDecision(SaveAction.SKIP)


def test_ram_schedule_saves_to_ram_without_backup():
  assert _decide(3, ram_due=lambda: True) == SaveDecision(SaveAction.LOCAL, backup=False)


def test_a_backup_is_taken_from_ram_so_the_step_goes_there_too():
  decision = _decide(3, persistent_due=lambda: True, ram_due=_never)
  assert decision == SaveDecision(SaveAction.LOCAL, backup=True)


def test_force_asks_no_schedule_and_backs_up():
  assert _decide(3, force=True, ram_due=_never, persistent_due=_never) == SaveDecision(
      SaveAction.LOCAL, backup=True)


def test_a_step_already_persistent_is_not_backed_up_again():
  assert _decide(3, force=True, persistent=(3,)) == SaveDecision(SaveAction.LOCAL, False)


def test_managed_mode_never_backs_up():
  assert _decide(3, force=True, managed=True, persistent_due=_never) == SaveDecision(
      SaveAction.LOCAL, backup=False)


def test_preemption_saves_on_demand_once():
  assert _decide(7, preempted=True).action is SaveAction.ONDEMAND
  assert _decide(7, preempted=True, ondemand_step=7).action is SaveAction.SKIP


def test_an_older_forced_step_goes_to_the_persistent_tier_only():
  assert _decide(2, force=True, ram=(4, 6)) == SaveDecision(SaveAction.OLDER_STEP, True)


def test_read_only_ram_backs_up_straight_from_the_arrays():
  assert _decide(3, force=True, read_only=True) == SaveDecision(
      SaveAction.PERSISTENT_ONLY, backup=True)
  assert _decide(3, read_only=True, ram_due=_never).action is SaveAction.SKIP


@given(step=st.integers(0, 10**6), force=st.booleans(), preempted=st.booleans(),
       read_only=st.booleans(), managed=st.booleans(), ram_due=st.booleans(),
       persistent_due=st.booleans(),
       ram=st.lists(st.integers(0, 10**6), max_size=4),
       persistent=st.lists(st.integers(0, 10**6), max_size=4))
def test_decisions_follow_the_rules(step, force, preempted, read_only, managed, ram_due,
                                    persistent_due, ram, persistent):
  decision = _decide(step, force=force, preempted=preempted, read_only=read_only,
                     managed=managed, ram=ram, persistent=persistent,
                     ram_due=lambda: ram_due, persistent_due=lambda: persistent_due)
  wants_backup = not managed and (force or preempted or persistent_due) and \
      step not in persistent
  wants_ram = not read_only and (force or preempted or wants_backup or ram_due)
  if preempted:
    assert decision.action is SaveAction.ONDEMAND
  elif not (wants_ram or wants_backup):
    assert decision.action is SaveAction.SKIP
  elif wants_ram:
    older = bool(ram) and step < max(ram)
    assert decision.action is (SaveAction.OLDER_STEP if older else SaveAction.LOCAL)
    if not older:
      assert decision.backup == wants_backup
  else:
    assert decision == SaveDecision(SaveAction.PERSISTENT_ONLY, backup=True)
  if decision.action in (SaveAction.LOCAL, SaveAction.PERSISTENT_ONLY) and decision.backup:
    assert step not in persistent  # never a backup of a step every process sees there


def test_ram_should_save_counts_agreed_steps_only():
  local = LocalCheckpointOptions(save_interval_steps=5)
  assert save_policy.ram_should_save(10, (), local, write_in_flight=False)
  assert not save_policy.ram_should_save(11, (), local, write_in_flight=False)
  # A node whose folder was wiped answers as the others: step 10 is held by the cluster.
  assert not save_policy.ram_should_save(10, (5, 10), local, write_in_flight=False)
  assert not save_policy.ram_should_save(
      10, (), LocalCheckpointOptions(read_only=True), write_in_flight=False)


def test_should_save_fn_sees_the_last_agreed_step():
  seen = []

  def fn(step, last):
    seen.append((step, last))
    return step - (last or 0) >= 3

  local = LocalCheckpointOptions(should_save_fn=fn)
  assert not save_policy.ram_should_save(5, (3,), local, write_in_flight=False)
  assert save_policy.ram_should_save(6, (1, 3), local, write_in_flight=False)
  assert seen == [(5, 3), (6, 3)]


def test_a_save_decision_policy_gets_the_write_in_flight():
  @dataclasses.dataclass
  class NotWhileSaving:
    def should_save(self, step, previous_steps, *, context):
      return not context.is_saving_in_progress

  local = LocalCheckpointOptions(save_decision_policy=NotWhileSaving())
  assert save_policy.ram_should_save(1, (), local, write_in_flight=False)
  assert not save_policy.ram_should_save(1, (), local, write_in_flight=True)


def test_should_save_fn_policy_composes_with_orbax_policies():
  policy = policies.AnySavePolicy([
      save_policy.ShouldSaveFnPolicy(lambda step, last: step == 7),
      policies.FixedIntervalPolicy(10)])
  context = policies.DecisionContext(is_saving_in_progress=False, reached_preemption=False,
                                     multiprocessing_options=None)
  def info(step):  # a PolicyCheckpointInfo of a RAM step
    return save_policy.step_info(step, 0.0)
  assert [s for s in range(21) if policy.should_save(info(s), [], context=context)] == [
      0, 7, 10, 20]


@pytest.mark.parametrize(("step", "last", "due"), [(10, 10, False), (20, 10, True),
                                                   (15, 10, False), (30, 20, True)])
def test_first_backup_counts_from_the_attempt_on_its_way(step, last, due):
  persistent = PersistentCheckpointOptions(save_interval_steps=10)
  assert save_policy.first_backup_due(step, last, persistent) is due


def test_save_cost_closes_a_cycle_at_each_ram_save():
  """A cycle's cost is its calls' time above the cheapest call after its save (what a call
  with nothing of a save to do costs), plus the loop's steps between its calls beyond their
  median; its call time, from its save's call to the next save's over its calls."""
  cost = save_policy.SaveCost(0.02)
  cost.add(0.0, 5.0)  # calls before any save count for nothing
  assert cost.began is None and cost.calls == 0
  assert cost.begin(10.0) is None  # the first save: no cycle before it
  cost.add(10.0, 10.2)
  cost.add(11.0, 11.1)  # its copies moving; the step before it 0.8 s
  cost.add(12.0, 12.01)  # nothing of it to do: the cheapest; the step before it 0.9 s
  cost.add(12.5, 12.51)  # steps of 0.49 s from here
  closed = cost.begin(13.0)
  # Steps 0.8, 0.9, 0.49, 0.49: median 0.645, so 0.155 + 0.255 s slower than it.
  assert closed == pytest.approx((0.2 + 0.09 + 0.41, 3.0 / 4))
  assert (cost.began, cost.calls, cost.spent, cost.outside) == (13.0, 0, 0.0, [])
  cost.add(13.0, 13.3)  # a save every call: its own call is the whole cost
  assert cost.begin(14.0) == pytest.approx((0.3, 1.0))  # one step: no median to compare


def test_a_step_slowed_beside_a_save_counts_up_to_one_median_more():
  assert save_policy.slowed([0.2, 0.2]) == 0.0  # too few steps to tell
  # The 0.25 s step counts 0.05 s; the 5 s one (an evaluation, say) only one median, 0.2 s.
  assert save_policy.slowed([0.2, 0.2, 0.25, 0.2, 5.0]) == pytest.approx(0.25)


@pytest.mark.parametrize("cost, call, budget, held", [
    (0.3, 0.2, 0.02, 175),  # 0.3 s is 2 % of 15 s: 75 calls of 0.2 s after step 100
    (0.003, 0.2, 0.02, 101),  # cheap saves: the next step may save
    (0.0, 0.0, 0.02, 101),  # no cycle yet: no hold
    (0.5, 0.0, 0.02, 101)])
def test_held_until_spans_a_cycles_cost_over_the_budget(cost, call, budget, held):
  assert save_policy.held_until(100, cost, call, budget) == held


def test_a_held_step_is_not_saved_and_the_policy_is_not_asked():
  asked = []

  class Policy:
    def should_save(self, step, previous_steps, *, context):
      asked.append(step.step)
      return True

  options = LocalCheckpointOptions(save_decision_policy=Policy())
  assert not save_policy.ram_should_save(5, [4], options, write_in_flight=False, held_until=6)
  assert asked == []
  assert save_policy.ram_should_save(6, [4], options, write_in_flight=False, held_until=6)
  assert asked == [6]


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, True, "2%"])
def test_a_save_overhead_budget_is_a_fraction(budget):
  with pytest.raises(ValueError, match="save_overhead_budget must be a fraction"):
    LocalCheckpointOptions(save_overhead_budget=budget)
  assert LocalCheckpointOptions(save_overhead_budget=1).save_overhead_budget == 1
