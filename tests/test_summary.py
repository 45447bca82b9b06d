"""Agreements on small records by reductions (summary.py) against what an all-gather of every
process's record would tell, and the bytes each process receives as the cluster grows."""

from __future__ import annotations

import random

import pytest

from orbax_mtc import agreement, reduction, row_codec, summary
from orbax_mtc.agreement import Fault, Status

_SUMMARIZED = (agreement.StartRecord, agreement.OutcomeRecord, agreement.ClockRecord,
               agreement.ReadBackRecord, agreement.OnDemandRecord, agreement.EntryRecord)


def _fault(rng: random.Random, p: int) -> Fault:
  roll = rng.random()
  if roll < 0.7:
    return Fault()
  backup = rng.choice([-1, -1, rng.randrange(0, 10**9)])
  return Fault(kind=f"Error{p}", message=f"process {p} failed: " + "x" * rng.randrange(200),
               backup_step=backup)


def _record(record_type: type, rng: random.Random, p: int):
  if record_type is agreement.StartRecord:
    return agreement.StartRecord(fault=_fault(rng, p))
  if record_type is agreement.OutcomeRecord:
    return agreement.OutcomeRecord(fault=_fault(rng, p))
  if record_type is agreement.ClockRecord:
    base = rng.choice([1_790_000_000_000, 2 ** 31 - 5, 0])
    return agreement.ClockRecord(commit_ms=rng.choice([0, base, base + rng.randrange(10)]))
  if record_type is agreement.ReadBackRecord:
    return agreement.ReadBackRecord(state=rng.choice(list(Status)))
  if record_type is agreement.OnDemandRecord:
    return agreement.OnDemandRecord(fault=_fault(rng, p), wants_backup=rng.random() < 0.8,
                                    in_budget=rng.random() < 0.8)
  return agreement.EntryRecord(step=rng.choice([-1, 0, 6, 2 ** 40, -(2 ** 45)]),
                               readable=rng.random() < 0.7)


@pytest.mark.parametrize("seed", range(40))
def test_every_answer_is_what_the_gathered_records_say(seed):
  rng = random.Random(seed)
  record_type = _SUMMARIZED[seed % len(_SUMMARIZED)]
  processes = rng.randrange(1, 40)
  records = [_record(record_type, rng, p) for p in range(processes)]
  found = summary.simulate(records)

  for name, _ in row_codec.codecs(record_type):
    values = [getattr(r, name) for r in records]
    if isinstance(values[0], bool):
      assert found.true(name) == reduction.Who.of(values)
      assert found.false(name) == reduction.Who.of([not v for v in values])
    elif isinstance(values[0], Status):
      for member in Status:
        assert found.state(name, member) == reduction.Who.of([v == member for v in values])
    elif isinstance(values[0], int):
      assert found.ranges[name] == (min(values), max(values))
  if hasattr(records[0], "fault"):
    own = [p for p, r in enumerate(records) if r.fault.present and r.fault.backup_step < 0]
    backup = [p for p, r in enumerate(records) if r.fault.present and r.fault.backup_step >= 0]
    assert found.own_faults == reduction.Who.of(p in own for p in range(processes))
    assert found.backup_faults == reduction.Who.of(p in backup for p in range(processes))
    named = own[:summary.NAMED_FAULTS] if own else backup[:1]
    assert found.faults == {p: records[p].fault for p in named}


def test_a_record_with_a_list_cannot_be_summarized():
  with pytest.raises(TypeError, match="SaveRecord.inventory: a Record field cannot be summarized"):
    summary.simulate([agreement.SaveRecord(step=1)])


def test_numbers_outside_the_range_are_refused():
  with pytest.raises(ValueError, match="outside the summarized range"):
    summary.simulate([agreement.EntryRecord(step=2 ** 62)])


def test_without_faults_one_round_and_the_rounds_the_faults_add():
  quiet = summary.simulate([agreement.OnDemandRecord(wants_backup=True)] * 5)
  assert len(quiet.rounds) == 1 and quiet.faults == {}
  one = summary.simulate([agreement.OnDemandRecord(), agreement.OnDemandRecord(
      fault=Fault("OSError", "disk full"))])
  assert len(one.rounds) == 2 and one.faults == {1: Fault("OSError", "disk full")}
  assert one.named("the save") == "the save"
  many = summary.simulate([agreement.StartRecord(fault=Fault("E", str(p))) for p in range(9)])
  assert len(many.rounds) == 3 and sorted(many.faults) == [0, 1, 2, 3]
  assert many.named("opening") == "opening (9 processes; the lowest 4 named)"


def _received(record: object, faulty: int, processes: int) -> int:
  """Bytes one process receives summarizing `record` with processes 0 to `faulty` - 1
  failing, out of `processes` (the vectors' sizes depend on the count alone, so only the
  first few processes' contributions are added up)."""
  bad = type(record)(**{**record.__dict__, "fault": Fault("OSError", "m" * 1200)})
  records = [bad] * faulty + [record] * 2

  def reduce(rnd: reduction.Round) -> reduction.Parts:
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))

  return summary.received_bytes(summary.summarize(records[0], 0, processes, reduce))


@pytest.mark.parametrize("hosts", [1_000, 10_000, 100_000])
def test_bytes_each_process_receives_stay_under_a_mebibyte_at_any_host_count(hosts):
  record = agreement.OnDemandRecord(wants_backup=True, in_budget=True)
  quiet, several = _received(record, 0, hosts), _received(record, 3, hosts)
  # The census is the same size at any host count; several faults add two bitmaps (one bit
  # per process each) and the named messages.
  assert quiet == reduction.received_bytes(4 * (4 + 6), hosts)  # 2 bools, 1 fault
  words = reduction.bitmap_words(hosts)
  messages = 3 * 2 * agreement.row_size(Fault) * 4
  assert several == quiet + reduction.received_bytes(2 * words * 4, hosts) + \
      reduction.received_bytes(messages, hosts)
  assert several < 2 ** 20
  # What the all-gather of the same records handed every process.
  assert reduction.gathered_bytes(8 * agreement.row_size(type(record)), hosts) > 10 * several
