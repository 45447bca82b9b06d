"""How a step's peer copies are spread over the `save()` calls after its local save (pure;
the same on every process: it reads only agreed counts).

Each non-blocking call issues its share of the step's chunks, so that the copies are out
before the next local save instead of flushed by it, blocking; they start at a call where
every node's write of the step is likely done. When the link cannot move a step within one
interval (the copies' calls waited for it: `next_stretch`), a step's copies are spread over
several intervals and the saves between go on without copies of their own, instead of
waiting for them; the spread follows only agreed figures (rule 8). The replicator
(peers/replication.py) and the RAM saver (save/ram.py) ask these.
"""

from __future__ import annotations

import dataclasses

# Bytes a non-blocking `progress()` issues before the interval between local saves is known;
# once it is, a step's copies are spread over it instead (`chunks_per_call`).
BYTES_PER_CALL = 128 << 20


def chunks_per_call(remaining_chunks: int, calls_between_saves: int | None, calls_seen: int,
                    floor: int, least: int = 1) -> int:
  """Chunks one non-blocking `progress()` issues, so that a step's copies are out before the
  next local save rather than flushed, blocking, by it (pure; the same on every process).

  Args:
    remaining_chunks: the chunks of the step's transfer not yet issued (agreed plan).
    calls_between_saves: the non-blocking calls (one per `save()`) seen between the last two
      local saves, the estimate of the coming interval; None before there is one.
    calls_seen: the non-blocking calls since the step was saved, this one included (its
      copies may have started at a later one: a process still writing, `start_call`).
    floor: the chunks of `BYTES_PER_CALL` (at least the window): each call's share without
      an estimate, or past it (the next local save may come any call).
    least: the fewest chunks a call issues with an estimate (the window: a link slower
      than the spread then has the last calls of the interval as slack).

  Returns:
    With an estimate, what is left spread evenly over this call and the calls left before
    the next local save (which would flush it, blocking), at least `least`: each call's
    chunks have a training step to move before the next call's collectives (and, on a CPU
    client, its computation) queue behind them. Else `floor`.
  """
  calls_left = (calls_between_saves or 0) - calls_seen  # after this one
  if calls_left < 0:
    return floor
  return max(least, -(-remaining_chunks // (calls_left + 1)))


def start_call(ready_call: int, calls_between_saves: int) -> int:
  """The call a planned step's copies start at, from the census's `copies_ready_call` (the
  call by which every node's previous write was done): that one, or the one after when a
  write outlasted the first call and a call would still be left before the next local save
  (`calls_between_saves`, the last interval), so that the chunks' read-ahead, queued behind
  the write on the writer thread, has had a step too (else the first chunks are read on the
  calling thread: 0.1-0.3 s a call at 1 GiB here)."""
  if 1 < ready_call and ready_call + 1 < calls_between_saves:
    return ready_call + 1
  return max(1, ready_call)


# Copies whose calls waited for the link longer than this share of the interval between two
# local saves, and than MIN_WAIT_MS, were issued faster than it moves them: the next step's
# are spread wider. (Below a few ms a wait is scheduling noise, not the link.)
WAIT_SHARE = 0.05
MIN_WAIT_MS = 20
# Quiet local saves in a row (no such waits) before the spread narrows by one interval, at
# first. A narrowing the link could not bear (waits again within the narrowed step's own
# intervals) is undone and doubles it, up to MOST_QUIET_SAVES: a link that needs the wider
# spread is probed rarely, each probe costing an interval or two of waits; a narrowing that
# held halves it again.
QUIET_SAVES = 2
MOST_QUIET_SAVES = 16


@dataclasses.dataclass(frozen=True)
class Stretch:
  """Over how many local intervals a step's copies are spread (the same on every process).

  Attributes:
    intervals: The intervals (1: out before the next local save).
    quiet: Local saves in a row whose copies did not wait for the link.
    patience: The quiet saves in a row that narrow the spread by one interval.
    probing: Local saves left in which waits mean the last narrowing was one too many.
  """

  intervals: int = 1
  quiet: int = 0
  patience: int = QUIET_SAVES
  probing: int = 0


def next_stretch(stretch: Stretch, waited_ms: int, interval_ms: int, most: int) -> Stretch:
  """The spread after a local save, from the census's `copies_wait_ms` (the most any process's
  calls waited for the copies' chunks since the previous local save) and the time between
  the two saves (process 0's clock: agreed).

  Waits over `WAIT_SHARE` of the interval and `MIN_WAIT_MS` double the spread (up to `most`
  intervals: `ReplicationOptions.max_spread_intervals`); after `patience` saves in a row
  without waits it narrows by one interval. Waits while a narrowing is probed (its step's
  intervals and the save after them) undo it and double `patience`; a probe that passes
  halves it.
  """
  intervals = max(1, min(most, stretch.intervals))
  if interval_ms <= 0:
    return dataclasses.replace(stretch, intervals=intervals)
  if waited_ms > max(WAIT_SHARE * interval_ms, MIN_WAIT_MS):
    if stretch.probing:  # back to the spread that bore the copies (not twice the narrowed)
      return Stretch(min(most, intervals + 1), 0, min(MOST_QUIET_SAVES, 2 * stretch.patience))
    return Stretch(max(1, min(most, 2 * intervals)), 0, stretch.patience)
  patience = stretch.patience
  if stretch.probing == 1:  # the narrowed spread bore its first step's copies
    patience = max(QUIET_SAVES, patience // 2)
  probing = max(0, stretch.probing - 1)
  quiet = stretch.quiet + 1 if waited_ms * 4 <= WAIT_SHARE * interval_ms else 0
  if quiet >= patience and intervals > 1:
    return Stretch(intervals - 1, 0, patience, probing=intervals)  # `intervals - 1` + 1 saves
  return Stretch(intervals, quiet, patience, probing)


def budget(calls_between_saves: int | None, stretch: Stretch) -> int | None:
  """The non-blocking calls a step's copies are spread over: the interval's times the
  stretch (the local saves between issue none)."""
  if calls_between_saves is None:
    return None
  return calls_between_saves * stretch.intervals
