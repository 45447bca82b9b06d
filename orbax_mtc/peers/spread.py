"""How a step's peer copies are spread over the `save()` calls before the next local save
(pure; the same on every process: it reads only agreed counts).

Each non-blocking call issues its share of the step's chunks, so that the copies are out
before the next local save instead of flushed by it, blocking; they start at a call where
every node's write of the step is likely done. The replicator (peers/replication.py) and the
RAM saver (save/ram.py) ask these.
"""

from __future__ import annotations

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
