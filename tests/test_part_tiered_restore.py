"""TieredRestore (orbax_mtc/restore/tiers.py) on its own: its neighbours (RamRestore,
PersistentTier, LocalTier, PeerStore, RamWriter, StepLedger, delete_local, agree) are small
fakes that record calls into one shared log and answer from a script. Orbax's restore of the
persistent tier runs through the real restore/persistent.py against the fake tier, whose step
folder holds a `default` item and whose `restore` answers a scripted value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest

from orbax_mtc import agreement, reduction, summary
from orbax_mtc.agreement import Status
from orbax_mtc.local import format as local_format
from orbax_mtc.restore.executor import RamRestoreResult
from orbax_mtc.restore.tiers import RestoreInfo, TieredRestore

_TARGETS = {"default": None}  # a JSON item: the persistent restore checks no leaves
_JSON = type(ocp.args.JsonRestore())


def _found(step: int, tier: str = "local") -> RamRestoreResult:
  return RamRestoreResult(found=True, value=f"ram-{step}", step=step, tier=tier, tried=False,
                          persistent_step=None, done=f"done-{step}")


def _missed(persistent_step: int | None = None, tried: bool = False) -> RamRestoreResult:
  return RamRestoreResult(found=False, value=None, step=None, tier="local", tried=tried,
                          persistent_step=persistent_step)


class _Ram:
  def __init__(self, log: list, results: list[RamRestoreResult], elastic: list[int]):
    self.log, self.results, self.elastic = log, results, elastic

  def restore(self, step, targets, single):
    self.log.append(("ram.restore", step))
    return self.results.pop(0)

  def write_back(self, done):
    self.log.append(("ram.write_back", done))

  def elastic_steps(self):
    self.log.append(("ram.elastic_steps",))
    return list(self.elastic)


class _Persistent:
  def __init__(self, log: list, root: Path, steps: list[int]):
    self.log, self.directory, self._steps = log, root, steps
    for step in steps:
      (root / str(step) / "default").mkdir(parents=True)

  def steps(self, read: bool = False):
    return list(self._steps)

  def step_directory(self, step):
    return self.directory / str(step)

  def restore(self, step, args, directory=None):
    self.log.append(("persistent.restore", step, type(args)))
    return f"persistent-{step}"


class _Local:
  def __init__(self, root: Path, steps: list[int]):
    self.directory, self.held = root, list(steps)

  def steps(self):
    return sorted(self.held)


class _Store:
  def __init__(self, log: list):
    self.log = log

  def drop_newer(self, step):
    self.log.append(("store.drop_newer", step))


class _Writer:
  def __init__(self, log: list):
    self.log = log

  def drain(self):
    self.log.append(("writer.drain",))


class _Ledger:
  """Agrees alone (one process) unless `outcomes` scripts the persistent check's records (one
  per process, reduced as the collective would)."""

  process_index = 0

  def __init__(self, log: list, persistent: tuple[int, ...], ram: tuple[int, ...]):
    self.log, self.persistent, self.ram = log, persistent, ram
    self.outcomes: list[Any] | None = None

  @property
  def process_count(self) -> int:
    return 1 if self.outcomes is None else len(self.outcomes)

  def summarize(self, record, what):
    self.log.append(("ledger.summarize", what))
    return summary.simulate([record])

  def reduce(self, rnd, what):
    self.log.append(("ledger.reduce", what))
    records = [rnd.record] if self.outcomes is None else self.outcomes
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))

  def keep_ram(self, keep):
    self.ram = tuple(s for s in self.ram if keep(s))
    self.log.append(("ledger.keep_ram", self.ram))

  def add_ram(self, steps):
    self.ram = tuple(sorted({*self.ram, *steps}))
    self.log.append(("ledger.add_ram", list(steps)))


class _Rig:
  """A TieredRestore over the fakes. `entries`: the other processes' EntryRecords."""

  def __init__(self, root: Path, *, results=(), local=(4, 6, 8), persistent=(2, 4),
               ram=(4, 6, 8), elastic=(), entries=None):
    self.log: list[tuple] = []
    self.entries, self.agreed = entries, []
    self.ram = _Ram(self.log, list(results), list(elastic))
    self.persistent = _Persistent(self.log, root / "persistent", list(persistent))
    self.local = _Local(root / "local", list(local))
    self.ledger = _Ledger(self.log, tuple(persistent), tuple(ram))
    self.tiers = TieredRestore(ram=self.ram, persistent=self.persistent, local=self.local,
                               store=_Store(self.log), writer=_Writer(self.log),
                               ledger=self.ledger, delete_local=self._delete_local,
                               summarize=self._summarize)

  def _delete_local(self, steps):
    self.log.append(("delete_local", list(steps)))
    self.local.held = [s for s in self.local.held if s not in steps]

  def _summarize(self, record, what):
    self.agreed.append((record, what))
    return summary.simulate([record, *(self.entries or [])])

  def restore(self, step):
    return self.tiers.restore(step, _TARGETS, True)


def _last(rig: _Rig) -> tuple[int | None, str]:
  assert isinstance(rig.tiers.last, RestoreInfo)
  assert rig.tiers.last.seconds >= 0
  return rig.tiers.last.step, rig.tiers.last.tier


def _deleted(rig: _Rig) -> list:
  return [e for e in rig.log if e[0] in ("delete_local", "store.drop_newer", "ledger.keep_ram")]


def test_latest_comes_from_ram_first_and_drops_the_abandoned_newer_steps(tmp_path):
  rig = _Rig(tmp_path, results=[_found(6)])
  assert rig.restore(None) == "ram-6"
  assert _last(rig) == (6, "local")
  # Recorded (newer RAM steps dropped, in-flight copies landed first) before the write-back.
  assert rig.log == [("ram.restore", None), ("ledger.add_ram", [6]), ("delete_local", [8]),
                     ("writer.drain",), ("store.drop_newer", 6), ("ledger.keep_ram", (4, 6)),
                     ("ram.write_back", "done-6")]
  assert rig.local.steps() == [4, 6]


def test_explicit_ram_step_keeps_newer_steps_and_records_the_result_tier(tmp_path):
  rig = _Rig(tmp_path, results=[_found(4, tier="peer")])
  assert rig.restore(4) == "ram-4"
  assert _last(rig) == (4, "peer")
  assert rig.log == [("ram.restore", 4), ("ledger.add_ram", [4]), ("ram.write_back", "done-4")]
  assert rig.local.steps() == [4, 6, 8] and rig.ledger.ram == (4, 6, 8)


def test_explicit_newest_listed_step_drops_the_leftovers_above_it(tmp_path):
  # `restore(latest_step())`: step 6 is the newest the cluster lists; this node's step 8 was
  # committed here alone (its other nodes died first), a leftover no restore can use.
  rig = _Rig(tmp_path, results=[_found(6)], ram=(4, 6))
  assert rig.restore(6) == "ram-6"
  assert _last(rig) == (6, "local")
  assert rig.log == [("ram.restore", 6), ("ledger.add_ram", [6]), ("delete_local", [8]),
                     ("writer.drain",), ("store.drop_newer", 6), ("ledger.keep_ram", (4, 6)),
                     ("ram.write_back", "done-6")]
  assert rig.local.steps() == [4, 6]


def test_latest_falls_back_to_the_persistent_step_ram_names(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(persistent_step=4)], local=(6, 8), ram=(6, 8))
  assert rig.restore(None) == "persistent-4"
  assert _last(rig) == (4, "persistent")
  assert rig.log == [("ram.restore", None), ("ledger.reduce", "checking persistent step 4"),
                     ("persistent.restore", 4, _JSON), ("delete_local", [6, 8]),
                     ("writer.drain",), ("store.drop_newer", 4), ("ledger.keep_ram", ())]


def test_explicit_persistent_step_keeps_the_ram_steps(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(persistent_step=2, tried=True)])
  assert rig.restore(2) == "persistent-2"
  assert _last(rig) == (2, "persistent")
  assert _deleted(rig) == [] and not any(e[0] == "ram.write_back" for e in rig.log)


def test_explicit_step_in_neither_tier_raises_file_not_found(tmp_path):
  rig = _Rig(tmp_path, results=[_missed()], local=(4, 6), persistent=(2,))
  with pytest.raises(FileNotFoundError, match=r"Step 5 is in neither tier.*\[4, 6\].*\[2\]"):
    rig.restore(5)
  assert rig.tiers.last is None and _deleted(rig) == []
  assert [e[0] for e in rig.log] == ["ram.restore"]


def test_explicit_step_tried_in_ram_and_not_persistent_raises_local_tier_error(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(tried=True)])
  with pytest.raises(local_format.LocalTierError, match="Step 6 is in the RAM tier"):
    rig.restore(6)
  assert rig.tiers.last is None and _deleted(rig) == []


def test_nothing_anywhere_starts_from_scratch_and_drops_every_ram_step(tmp_path):
  rig = _Rig(tmp_path, results=[_missed()], persistent=())
  assert rig.restore(None) is None
  assert _last(rig) == (None, "none")
  assert rig.log == [("ram.restore", None), ("delete_local", [4, 6, 8]), ("writer.drain",),
                     ("store.drop_newer", -1), ("ledger.keep_ram", ())]


def test_persistent_mismatch_deletes_nothing(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(persistent_step=4)])
  rig.ledger.outcomes = [agreement.BuildRecord(),
                         agreement.BuildRecord(status=Status.MISMATCH, message="leaf w")]
  with pytest.raises(local_format.AbstractStateMismatchError, match="process 1: leaf w"):
    rig.restore(None)
  assert rig.tiers.last is None and _deleted(rig) == []
  assert not any(e[0] == "persistent.restore" for e in rig.log)


def test_replicator_entry_everyone_names_and_reads_is_restored_from_ram(tmp_path):
  rig = _Rig(tmp_path, results=[_found(6)], entries=[agreement.EntryRecord(6, True)])
  rig.tiers.replicator_entry = 6
  assert rig.restore(None) == "ram-6"
  assert rig.agreed == [(agreement.EntryRecord(step=6, readable=True),
                         "the replicator's restore entries")]
  assert _last(rig) == (6, "replicator")
  assert rig.tiers.replicator_entry is None
  # The entry's step is asked for by number; newer RAM steps belong to the abandoned
  # timeline (kept, the next save of step 8 would raise at every restart).
  assert rig.log[:4] == [("ram.restore", 6), ("ledger.add_ram", [6]), ("delete_local", [8]),
                         ("writer.drain",)]
  assert rig.log[-1] == ("ram.write_back", "done-6")


def test_replicator_entry_unusable_in_ram_falls_back_to_the_usual_plan(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(), _found(4)])
  rig.tiers.replicator_entry = 6
  assert rig.restore(None) == "ram-4"
  assert _last(rig) == (4, "local")
  assert [e for e in rig.log if e[0] == "ram.restore"] == [("ram.restore", 6),
                                                             ("ram.restore", None)]
  assert ("delete_local", [6, 8]) in rig.log


@pytest.mark.parametrize("mine, local, others", [
    (6, (4, 6, 8), [agreement.EntryRecord(8, True)]),  # the entries disagree
    (6, (4, 8), [agreement.EntryRecord(6, True)]),     # this process cannot read its entry
    (6, (4, 6, 8), [agreement.EntryRecord(6, False)]),  # another process cannot
])
def test_replicator_entry_not_agreed_uses_the_usual_plan(tmp_path, mine, local, others):
  rig = _Rig(tmp_path, results=[_found(4)], local=local, entries=others)
  rig.tiers.replicator_entry = mine
  assert rig.restore(None) == "ram-4"
  assert rig.agreed[0][0] == agreement.EntryRecord(step=mine, readable=mine in local)
  assert _last(rig) == (4, "local")
  assert [e for e in rig.log if e[0] == "ram.restore"] == [("ram.restore", None)]


def test_replicator_entry_zero_restores_the_newest_step_the_cluster_holds(tmp_path):
  """Entries saying "nothing" (a step 0 they cannot name, a daemon that lags) leave the
  cluster's RAM steps to the usual plan, which `latest_step()` lists: starting from scratch
  or from an older persistent step dropped them."""
  rig = _Rig(tmp_path, results=[_found(8)], persistent=(2, 4),
             entries=[agreement.EntryRecord(0, False)])
  rig.tiers.replicator_entry = 0
  assert rig.restore(None) == "ram-8"
  assert _last(rig) == (8, "local")
  assert [e for e in rig.log if e[0] == "ram.restore"] == [("ram.restore", None)]
  assert rig.local.steps() == [4, 6, 8]  # nothing dropped
  assert rig.tiers.replicator_entry is None


def test_replicator_entry_zero_without_ram_steps_takes_the_newest_persistent_step(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(persistent_step=4)], local=(), ram=(),
             entries=[agreement.EntryRecord(0, False)])
  rig.tiers.replicator_entry = 0
  assert rig.restore(None) == "persistent-4"
  assert _last(rig) == (4, "persistent")
  assert ("persistent.restore", 4, _JSON) in rig.log


def test_replicator_entry_zero_with_nothing_anywhere_starts_from_scratch(tmp_path):
  rig = _Rig(tmp_path, results=[_missed()], local=(), ram=(), persistent=())
  rig.tiers.replicator_entry = 0
  assert rig.restore(None) is None
  assert _last(rig) == (None, "none")
  assert ("store.drop_newer", -1) in rig.log


def test_replicator_entry_is_honoured_once_and_only_by_restore_none(tmp_path):
  rig = _Rig(tmp_path, results=[_found(6), _found(6)])
  rig.tiers.replicator_entry = 6
  assert rig.restore(None) == "ram-6" and _last(rig) == (6, "replicator")
  assert rig.restore(None) == "ram-6" and _last(rig) == (6, "local")
  assert len(rig.agreed) == 1


def test_ram_only_answers_found_and_value_and_never_asks_the_persistent_tier(tmp_path):
  rig = _Rig(tmp_path, results=[_found(6, tier="elastic"), _missed(persistent_step=4)],
             persistent=(2, 4))
  assert rig.tiers.ram_only(None, _TARGETS, True) == (True, "ram-6")
  assert _last(rig) == (6, "elastic")
  assert ("delete_local", [8]) in rig.log and ("ram.write_back", "done-6") in rig.log
  rig.log.clear()
  assert rig.tiers.ram_only(4, _TARGETS, True) == (False, None)
  assert rig.log == [("ram.restore", 4)]  # no persistent restore, no scratch drop
  assert _last(rig) == (6, "elastic")


def test_list_elastic_steps_adds_them_to_the_agreed_ram_steps(tmp_path):
  rig = _Rig(tmp_path, elastic=[3, 9])
  rig.tiers.list_elastic_steps()
  assert rig.log == [("ram.elastic_steps",), ("ledger.add_ram", [3, 9])]


def test_persistent_restore_is_given_composite_args_for_named_items(tmp_path):
  rig = _Rig(tmp_path, results=[_missed(persistent_step=4)])
  (rig.persistent.step_directory(4) / "state").mkdir()
  assert rig.tiers.restore(4, {"state": None}, False) == "persistent-4"
  assert ("persistent.restore", 4, ocp.args.Composite) in rig.log


def test_an_explicit_restore_ends_the_replicator_entry(tmp_path):
  """MaxText resumes by `restore(latest_step())` in managed mode: a later restore(None) (the
  job has saved since) must plan as usual, not go back to the entry's step and drop the
  newer ones."""
  rig = _Rig(tmp_path, results=[_found(8), _found(8)], entries=[agreement.EntryRecord(6, True)])
  rig.tiers.replicator_entry = 6
  assert rig.restore(8) == "ram-8"
  assert rig.tiers.replicator_entry is None
  assert rig.restore(None) == "ram-8"
  assert rig.agreed == []  # no entry agreement
  assert rig.local.steps() == [4, 6, 8]
