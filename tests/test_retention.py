"""Retention policies for the persistent tier over generated histories (pure functions)."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from orbax_mtc.tools.retention import RetentionPolicy, StepRecord, decide, describe

UTC = dt.UTC
NOW = dt.datetime(2026, 11, 22, 12, 30, tzinfo=UTC)  # a Sunday


def history(every_minutes: int, hours: float, steps_per_save: int = 100):
  """A save every `every_minutes` for `hours` up to NOW, steps 0, 100, 200, ..."""
  count = int(hours * 60 // every_minutes) + 1
  start = NOW - dt.timedelta(minutes=every_minutes * (count - 1))
  return [StepRecord(i * steps_per_save, start + dt.timedelta(minutes=every_minutes * i))
          for i in range(count)]


def test_keep_latest():
  records = history(10, 2)
  decision = decide(records, RetentionPolicy(keep_latest=3), NOW)
  assert list(decision.keep) == [s.step for s in records[-3:]]
  assert decision.delete == tuple(s.step for s in records[:-3])


def test_keep_every():
  records = history(10, 2)
  decision = decide(records, RetentionPolicy(keep_every=500), NOW)
  newest = records[-1].step
  assert set(decision.keep) == {s.step for s in records if s.step % 500 == 0} | {newest}


def test_hourly_keeps_newest_per_hour_for_h_hours():
  records = history(10, 30)  # 30 hours of saves every 10 minutes
  decision = decide(records, RetentionPolicy(hourly=24), NOW)
  kept = [r for r in records if r.step in decision.keep]
  hours = {r.time.replace(minute=0, second=0, microsecond=0) for r in kept}
  assert len(kept) == 24 and len(hours) == 24
  for r in kept:  # the newest of its hour
    same_hour = [x for x in records if x.time.replace(minute=0) == r.time.replace(minute=0)]
    assert r.step == max(x.step for x in same_hour)
  assert min(hours) == dt.datetime(2026, 11, 21, 13, tzinfo=UTC)


def test_daily_and_weekly_buckets_follow_the_calendar():
  records = history(6 * 60, 24 * 40)  # every 6 hours for 40 days
  decision = decide(records, RetentionPolicy(daily=7, weekly=5), NOW)
  daily = [r for r in records
           if any(w.startswith("daily") for w in decision.keep.get(r.step, ()))]
  assert [r.time.date() for r in daily] == [
      dt.date(2026, 11, d) for d in range(16, 23)]
  assert all(r.time.hour == 18 for r in daily[:-1]) and daily[-1].time == NOW
  weekly = [r for r in records if any(w.startswith("weekly") for w in decision.keep.get(
      r.step, ()))]
  mondays = {(r.time - dt.timedelta(days=r.time.weekday())).date() for r in weekly}
  assert len(weekly) == 5 and len(mondays) == 5
  # The newest of each week: Sundays 18:00 for full weeks, NOW for the current one.
  assert sorted(r.time.weekday() for r in weekly) == [6] * 5


def test_policies_compose_and_never_drop_newest_or_unfinished():
  rng = random.Random(7)
  t = NOW - dt.timedelta(days=20)
  records, step = [], 0
  while t < NOW:
    records.append(StepRecord(step, t, complete=True))
    step += rng.randint(1, 300)
    t += dt.timedelta(minutes=rng.randint(5, 400))
  records.append(StepRecord(step, NOW, complete=False))  # being written now
  policy = RetentionPolicy(keep_latest=3, keep_every=1000, hourly=24, daily=7, weekly=5)
  decision = decide(records, policy, NOW)
  union = set()
  for single in (RetentionPolicy(keep_latest=3), RetentionPolicy(keep_every=1000),
                 RetentionPolicy(hourly=24), RetentionPolicy(daily=7),
                 RetentionPolicy(weekly=5)):
    union |= set(decide(records, single, NOW).keep)
  assert set(decision.keep) == union
  assert step in decision.keep and decision.keep[step] == ("being written",)
  newest_complete = records[-2].step
  assert "newest" in decision.keep[newest_complete]
  assert set(decision.delete).isdisjoint(decision.keep)
  assert set(decision.delete) | set(decision.keep) == {r.step for r in records}
  lines = describe(decision, records)
  assert lines[0].startswith("keep") and len(lines) == len(records)


def test_empty_policy_keeps_only_newest():
  records = history(10, 1)
  assert RetentionPolicy().is_empty
  decision = decide(records, RetentionPolicy(), NOW)
  assert list(decision.keep) == [records[-1].step]


@pytest.mark.parametrize("kwargs,match", [
    ({"keep_latest": -1}, "keep_latest must be an int >= 0"),
    ({"keep_every": 0}, "keep_every must be an int >= 1"),
    ({"hourly": 1.5}, "hourly must be an int >= 0"),
])
def test_bad_policies(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RetentionPolicy(**kwargs)


def test_naive_times_and_duplicates_are_refused():
  with pytest.raises(ValueError, match="time zone"):
    decide([StepRecord(1, dt.datetime(2026, 1, 1))], RetentionPolicy(hourly=1), NOW)
  with pytest.raises(ValueError, match="duplicate"):
    decide([StepRecord(1, NOW), StepRecord(1, NOW)], RetentionPolicy(), NOW)


# ----------------------------------------------------------------------------- orbax-mtc gc


@pytest.fixture
def orbax_dir(shm_dir):
  """Ten steps written by plain Orbax, plus a step still being written (an Orbax tmp folder)."""
  import numpy as np
  import orbax.checkpoint as ocp

  directory = shm_dir / "persistent"
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False)) as mgr:
    for step in range(0, 1000, 100):
      mgr.save(step, args=ocp.args.PyTreeSave({"x": np.arange(4) + step}))
  (directory / "1000.orbax-checkpoint-tmp-123").mkdir()
  return directory


def _steps(directory):
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_gc_dry_run_then_delete(orbax_dir, capsys):
  from orbax_mtc.tools import cli

  argv = ["gc", str(orbax_dir), "--keep-latest", "2", "--keep-every", "400"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "5 kept, 6 to delete (dry run" in out and "being written" in out
  assert _steps(orbax_dir) == list(range(0, 1000, 100))  # nothing deleted yet

  assert cli.main([*argv, "--delete"]) == 0
  out = capsys.readouterr().out
  assert _steps(orbax_dir) == [0, 400, 800, 900]
  assert (orbax_dir / "1000.orbax-checkpoint-tmp-123").is_dir()
  assert not [p for p in orbax_dir.iterdir() if "mtc-gc" in p.name]
  # What is left is still a checkpoint directory plain Orbax reads.
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(orbax_dir) as mgr:
    assert list(mgr.all_steps()) == [0, 400, 800, 900]
    restored = mgr.restore(900, args=ocp.args.PyTreeRestore())
  assert list(restored["x"]) == [900, 901, 902, 903]


def test_gc_refuses_without_rules_or_directory(orbax_dir, shm_dir, capsys):
  from orbax_mtc.tools import cli

  assert cli.main(["gc", str(orbax_dir)]) == 2
  assert "no retention rule given" in capsys.readouterr().err
  assert cli.main(["gc", str(shm_dir / "missing"), "--keep-latest", "1"]) == 2
  assert "is not a directory" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["gc", str(orbax_dir), "--keep-every", "0", "--delete"])
  assert exit_info.value.code == 2
  assert "argument --keep-every: must be a whole number >= 1, got 0" in capsys.readouterr().err
  assert _steps(orbax_dir) == list(range(0, 1000, 100))
