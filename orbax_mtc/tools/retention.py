"""Persistent-tier retention as policies that compose (pure: no I/O).

A step is kept when any rule keeps it; the rest may be deleted. The rules:
- `keep_latest=N`: the N newest complete steps;
- `keep_every=K`: every complete step that is a multiple of K;
- `hourly=H`, `daily=D`, `weekly=W`: calendar buckets (UTC hours, UTC days, ISO weeks
  starting on Monday). Of the H hour-buckets ending with the current one, each keeps its
  newest complete step; the same for days and weeks.
Whatever the rules say, the newest complete step and every step still being written (not
complete) are never deleted.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence

_UTC = dt.UTC


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One step of a checkpoint directory.

  Attributes:
    step: The step number.
    time: Its commit time; must carry a time zone (compared in UTC).
    complete: True if finalized, False if still being written.
  """

  step: int
  time: dt.datetime
  complete: bool = True


def _check_count(name: str, value: int | None) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"RetentionPolicy.{name} must be an int >= 0, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
  """Which persistent steps to keep (see the module docstring for the rules).

  Attributes:
    keep_latest: Keep the N newest complete steps; None for no such rule.
    keep_every: Keep every complete step that is a multiple of K; None for no such rule.
    hourly: Keep the newest complete step of each of the last H UTC hours (0: off).
    daily: Keep the newest complete step of each of the last D UTC days (0: off).
    weekly: Keep the newest complete step of each of the last W ISO weeks (0: off).

  Raises:
    ValueError: If a count is not an int >= 0, or `keep_every` is not an int >= 1.
  """

  keep_latest: int | None = None
  keep_every: int | None = None
  hourly: int = 0
  daily: int = 0
  weekly: int = 0

  def __post_init__(self):
    for name in ("keep_latest", "hourly", "daily", "weekly"):
      _check_count(name, getattr(self, name))
    if self.keep_every is not None and (
        isinstance(self.keep_every, bool) or not isinstance(self.keep_every, int)
        or self.keep_every < 1):
      raise ValueError(f"RetentionPolicy.keep_every must be an int >= 1 (keep every K-th "
                       f"step), got {self.keep_every!r}.")

  @property
  def is_empty(self) -> bool:
    """No rule set: such a policy would keep only the newest step, so callers refuse it."""
    return (self.keep_latest is None and self.keep_every is None
            and not (self.hourly or self.daily or self.weekly))


@dataclasses.dataclass(frozen=True)
class RetentionDecision:
  """What a `RetentionPolicy` keeps and deletes.

  Attributes:
    keep: Step -> the rules that keep it (sorted by step).
    delete: Steps to remove, oldest first.
  """

  keep: dict[int, tuple[str, ...]]
  delete: tuple[int, ...]


def _hour(t: dt.datetime) -> dt.datetime:
  return t.replace(minute=0, second=0, microsecond=0)


def _day(t: dt.datetime) -> dt.datetime:
  return t.replace(hour=0, minute=0, second=0, microsecond=0)


def _week(t: dt.datetime) -> dt.datetime:
  return _day(t) - dt.timedelta(days=t.weekday())  # Monday of the ISO week


_BUCKETS = (("hourly", _hour, dt.timedelta(hours=1)), ("daily", _day, dt.timedelta(days=1)),
            ("weekly", _week, dt.timedelta(weeks=1)))


def _utc(t: dt.datetime) -> dt.datetime:
  if t.tzinfo is None:
    raise ValueError(f"times must carry a time zone (UTC), got naive {t!r}.")
  return t.astimezone(_UTC)


def decide(records: Iterable[StepRecord], policy: RetentionPolicy,
           now: dt.datetime) -> RetentionDecision:
  """Applies `policy` to `records` at time `now`.

  Args:
    records: The steps of the checkpoint directory.
    policy: The rules to apply.
    now: The current time; must carry a time zone.

  Returns:
    The `RetentionDecision`.

  Raises:
    ValueError: If two records have the same step, or `now` or a bucketed record's time is
      naive (has no time zone).
  """
  records = sorted(records, key=lambda r: r.step)
  steps = [r.step for r in records]
  if len(set(steps)) != len(steps):
    raise ValueError(f"duplicate step numbers in {steps}.")
  now = _utc(now)
  reasons: dict[int, list[str]] = {r.step: [] for r in records}
  complete = [r for r in records if r.complete]
  for r in records:
    if not r.complete:
      reasons[r.step].append("being written")
  if complete:
    reasons[complete[-1].step].append("newest")
  if policy.keep_latest:
    for r in complete[-policy.keep_latest:]:
      reasons[r.step].append(f"latest {policy.keep_latest}")
  if policy.keep_every is not None:
    for r in complete:
      if r.step % policy.keep_every == 0:
        reasons[r.step].append(f"every {policy.keep_every}")
  for name, floor, width in _BUCKETS:
    count = getattr(policy, name)
    if not count:
      continue
    oldest_bucket = floor(now) - (count - 1) * width
    newest_in: dict[dt.datetime, StepRecord] = {}
    for r in complete:
      bucket = floor(_utc(r.time))
      if oldest_bucket <= bucket <= floor(now):
        best = newest_in.get(bucket)
        if best is None or (_utc(r.time), r.step) > (_utc(best.time), best.step):
          newest_in[bucket] = r
    for bucket, r in newest_in.items():
      reasons[r.step].append(f"{name} {bucket.isoformat()}")
  keep = {s: tuple(why) for s, why in sorted(reasons.items()) if why}
  delete = tuple(s for s in steps if s not in keep)
  return RetentionDecision(keep=keep, delete=delete)


def describe(decision: RetentionDecision, records: Sequence[StepRecord]) -> list[str]:
  """Renders a decision as text, one line per step, newest first.

  Args:
    decision: What `decide` returned for `records`.
    records: The steps the decision was made on.

  Returns:
    Lines of 'keep'/'delete', step, UTC time and, for kept steps, the reasons.

  Raises:
    ValueError: If a record's time is naive (has no time zone).
  """
  by_step = {r.step: r for r in records}
  lines = []
  for step in sorted(by_step, reverse=True):
    r = by_step[step]
    when = _utc(r.time).strftime("%Y-%m-%d %H:%M:%S")
    if step in decision.keep:
      lines.append(f"keep    {step:>10}  {when}  {', '.join(decision.keep[step])}")
    else:
      lines.append(f"delete  {step:>10}  {when}")
  return lines
