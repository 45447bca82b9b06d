"""Bytes each process receives per agreement, against the host count (part of
`orbax-mtc bench elastic-scale`).

The save agreement runs at every local save. Before, it was an all-gather of one
`SaveRecord` row per process; now it is save_census's reductions, whose vectors do not grow
with the cluster (the coverage round, run only while some nodes lack a step, has one byte per
node and step). The simulation builds every host's record (2 replicas, 3 RAM steps, a ring peer
copy each, one persistent step; `lost` hosts replaced with empty folders), runs the rounds with
the reduction in numpy, and checks the answer against the all-gather's decision where the
exact simulation is affordable (the coverage round adds up P contributions of P bytes: at
100,000 hosts its answer is checked in bulk instead).

Replication's agreements (`replication`): a status round at each `save()` call while a node
still writes its step, one round of the bytes per copy edge once per step (before: an
all-gather of every process's row of one size per edge, at every such call).

The restore agreement (`restore_agreement`) was an all-gather of `RestoreRecord` rows (the
inventory and a 1 KiB folder report), then of a `CoverRecord`; now it is the save census with
the step asked for (restoring) and restore/census's planning rounds. Two restarts after 1% of
the hosts died: on the survivors alone (renumbered, fewer processes: an elastic restore), and
with the lost hosts replaced by empty ones (the same process count). The rounds run process
by process up to `EXACT_UP_TO` hosts and their plan is checked against the all-gather's;
beyond, the planning rounds' sizes come from `census.planning_vectors` (pinned equal to the
simulated rounds below that), for the servers the old plan chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_mtc import agreement, reduction, save_census
from orbax_mtc import step_listing as listing
from orbax_mtc.agreement import Inventory, SaveRecord, Status
from orbax_mtc.peers import send_census
from orbax_mtc.restore import census, outcome
from orbax_mtc.restore import plan as restore_plan

RAM_STEPS = (1000, 1100, 1200)
PERSISTENT = (1000,)
SAVED = 1300
EXACT_UP_TO = 10_000  # hosts simulated round by round; beyond, the coverage answer in bulk


def _records(hosts: int, lost: Sequence[int]) -> tuple[list[SaveRecord], list[int]]:
  gone = set(lost)
  half = hosts // 2
  records = []
  for host in range(hosts):
    if host in gone:  # a replaced node: an empty folder
      inv = Inventory.of([], [], PERSISTENT)
    else:
      inv = Inventory.of(RAM_STEPS, [((host - 1) % hosts, s) for s in RAM_STEPS], PERSISTENT)
    records.append(SaveRecord(step=SAVED, inventory=inv, clock_ms=1_790_000_000_000 + host))
  return records, [host % half for host in range(hosts)]  # twins: same place, other replica


def _bulk_coverage(records: Sequence[SaveRecord], groups: Sequence[int]) -> reduction.Parts:
  """The coverage round's reduced vector, computed for all nodes at once: for each step some
  node lacks (ascending, as the census's slots), 1 where a node's data has a source."""
  count, ids = len(records), np.asarray(groups)
  held = {s for r in records for s in (*r.inventory.own_steps,
                                       *(s for _, s in r.inventory.copies))}
  steps = [s for s in sorted(held)
           if sum(s in r.inventory.own_steps for r in records) < count]
  flags = np.zeros((len(steps), count), np.uint8)
  for k, step in enumerate(steps):
    own = np.asarray([step in r.inventory.own_steps for r in records])
    flags[k, own] = 1
    flags[k, np.isin(ids, ids[own])] = 1
    for holder, r in enumerate(records):
      for source, at in r.inventory.copies:
        if at == step and source != holder and 0 <= source < count:
          flags[k, source] = 1
  return reduction.Parts(np.zeros(0, np.int32), np.zeros(0, np.int32), flags.reshape(-1))


def _reducer(records: Sequence[SaveRecord], groups: Sequence[int], exact: bool):
  """The reduction of a simulated cluster: round by round, or the coverage round in bulk."""
  def reduce(rnd: reduction.Round) -> reduction.Parts:
    if not exact and rnd.parts().flags.size:
      return _bulk_coverage(records, groups)
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))

  return reduce


def _old(records: Sequence[SaveRecord], groups: Sequence[int]) -> tuple[int, ...]:
  nodes = [listing.NodeInventory(frozenset(r.inventory.own_steps), frozenset(r.inventory.copies))
           for r in records]
  return tuple(listing.restorable_steps(nodes, groups))


def save_agreement(hosts: int, lost: Sequence[int]) -> dict[str, Any]:
  """The save agreement's bytes per process at `hosts`, before and after, in steady state
  (every node holds every step) and after `lost` nodes were replaced."""
  row = 8 * agreement.row_size(SaveRecord)
  out: dict[str, Any] = {"save_row_bytes": row,
                         "save_before_bytes": reduction.gathered_bytes(row, hosts)}
  for case, gone in (("steady", ()), ("lost", lost)):
    records, groups = _records(hosts, gone)
    exact = hosts <= EXACT_UP_TO
    answer = save_census.agree(records[0], 0, hosts, groups, [*RAM_STEPS, *PERSISTENT],
                               PERSISTENT, _reducer(records, groups, exact))
    expected = _old(records, groups)
    if answer.ram != expected:
      raise AssertionError(f"{hosts} hosts ({case}): the reduced answer lists {answer.ram}, "
                           f"the all-gather's {expected}")
    vectors = [p.nbytes for p in answer.rounds]
    out[f"save_{case}_rounds"] = len(vectors)
    out[f"save_{case}_vector_bytes"] = sum(vectors)
    out[f"save_{case}_bytes"] = sum(reduction.received_bytes(v, hosts) for v in vectors)
    out[f"save_{case}_exact"] = exact
  out.update(replication(hosts))
  return out


def _folded(mines: Sequence[census.Mine]):
  """A simulated cluster's reduction, one process at a time (memory: one vector)."""
  def reduce(rnd: reduction.Round) -> reduction.Parts:
    total = None
    for p, mine in enumerate(mines):
      part = rnd.contribute(mine, p)
      if total is None:
        total = reduction.Parts(part.add.astype(np.int64), part.top.copy(), part.flags.copy())
      else:
        total.add += part.add
        np.maximum(total.top, part.top, out=total.top)
        np.maximum(total.flags, part.flags, out=total.flags)
    assert total is not None
    return reduction.Parts(total.add.astype(np.int32), total.top, total.flags)
  return reduce


def _planning(reports: Sequence[restore_plan.HostReport], covers, exact: bool
              ) -> tuple[list[int], int]:
  """The planning rounds' vector sizes (the plan checked against the old one where exact),
  and how many ranks' servers travel as process indices."""
  old = restore_plan.plan(reports, covers)
  if old is None:
    raise AssertionError("the simulated restart should find a step")
  processes = len(reports)
  coded = sum(p != r for r, p, _ in old.servers)
  holders = next(c for c in restore_plan.candidates(reports)
                 if (c.step, c.count, c.digest) == (old.step, old.count, old.digest)).holders
  shared = sum(len({p for p, k in h if census.TIER[k] == max(census.TIER[j] for _, j in h)})
               > 1 for h in holders.values())
  if not exact:
    if shared:
      raise AssertionError("the bulk figure assumes one holder per rank's best kind")
    return census.planning_vectors(old.count, processes, coded), coded
  mines = [census.holdings(r, p) for p, r in enumerate(reports)]
  rounds: list[reduction.Parts] = []
  reduce = _folded(mines)

  def facts(p, agreed):
    return [bool(mines[p].get(a.save)) for a in agreed], [covers(a) for a in agreed]
  chosen, cover, _ = census.choose(mines[0], 0, reduce, facts, rounds=rounds)
  assert chosen is not None and cover is not None
  servers = census.agree_servers(mines[0], 0, chosen, cover, processes, reduce, rounds)
  new = restore_plan.ElasticPlan(chosen.step, chosen.count, chosen.digest, servers)
  if new != old:
    raise AssertionError(f"the reductions chose {new}, the all-gather {old}")
  vectors = [r.nbytes for r in rounds]
  if not shared and vectors != census.planning_vectors(old.count, processes, coded):
    raise AssertionError(f"planning rounds of {vectors} bytes, not the formula's")
  return vectors, coded


def restore_agreement(hosts: int, lost: Sequence[int],
                      survivors: Sequence[restore_plan.HostReport], covers,
                      streams: int, most: int, rounds: int) -> dict[str, Any]:
  """The restore agreement's bytes per process at `hosts`: before (all-gathers of the
  `RestoreRecord` and `CoverRecord` rows), after (census + planning rounds), on the
  `survivors` alone (their reports, renumbered) and with the `lost` hosts replaced; and the
  survivors' exchange (of `streams` streams, at most `most` from one process, moved in
  `rounds` rounds) and build outcome."""
  row = 8 * agreement.row_size(agreement.RestoreRecord)
  cover_row = 8 * 2  # the CoverRecord's two int64 (a restore not planned on its fast path)
  out: dict[str, Any] = {"restore_row_bytes": row}
  exact = hosts <= EXACT_UP_TO
  gone = set(lost)
  by_host = iter(survivors)
  replaced = [restore_plan.HostReport() if h in gone else next(by_host) for h in range(hosts)]
  for case, reports, records_of in (
      ("elastic", survivors, lambda: _records(len(survivors), ())),
      ("replaced", replaced, lambda: _records(hosts, lost))):
    processes = len(reports)
    out[f"restore_{case}_before_bytes"] = reduction.gathered_bytes(row + cover_row, processes)
    records, groups = records_of()
    records = [SaveRecord(step=-1, inventory=r.inventory) for r in records]
    answer = save_census.agree(records[0], 0, processes, groups, [*RAM_STEPS, *PERSISTENT],
                               PERSISTENT, _reducer(records, groups, exact), restoring=True)
    if answer.ram != _old(records, groups):
      raise AssertionError(f"{hosts} hosts ({case}): the restore census lists {answer.ram}")
    planning, out[f"restore_{case}_coded"] = _planning(reports, covers, exact)
    vectors = [p.nbytes for p in answer.rounds] + planning
    out[f"restore_{case}_rounds"] = len(vectors)
    out[f"restore_{case}_bytes"] = sum(reduction.received_bytes(v, processes) for v in vectors)
  # The survivors' exchange and build outcome: gathered before (the exchange with one int64
  # size per ordered pair of processes), reduced now.
  processes = len(survivors)
  build_row = 8 * agreement.row_size(agreement.BuildRecord)
  serve_row = 8 * (agreement.row_size(agreement.ServeRecord) + processes * (processes - 1))
  out["streams"] = streams
  out["outcome_before_bytes"] = reduction.gathered_bytes(build_row, processes)
  out["outcome_after_bytes"] = outcome.outcome_bytes(processes)
  out["serve_before_bytes"] = reduction.gathered_bytes(serve_row, processes)
  out["serve_after_bytes"] = outcome.exchange_bytes(processes, streams, most, rounds)
  out["exchange_rounds"] = rounds
  out["streams_most"] = most
  return out


def replication(hosts: int) -> dict[str, Any]:
  """Replication's agreements at `hosts` (one peer per host, a ring of copy edges): before, an
  all-gather of a `SendRecord` row with one int64 size per edge at every call while a node
  writes; after, a status round at each such call and one sizes round per step."""
  edges = [(h, (h + 1) % hosts) for h in range(hosts)]
  small = np.asarray([1 << 30 if src == 0 else 0 for src, _ in edges])  # 1 GiB a stream
  row = 8 * (agreement.row_size(agreement.SendRecord) + len(edges))
  status = send_census.status(Status.WRITING, 0, small).nbytes
  narrow = send_census.sizes(edges, 0, small, bits=31).nbytes
  wide = send_census.sizes(edges, 0, 3 * small, bits=32).nbytes  # 3 GiB a stream
  return {"replication_before_bytes": reduction.gathered_bytes(row, hosts),
          "replication_status_bytes": reduction.received_bytes(status, hosts),
          "replication_sizes_bytes": reduction.received_bytes(narrow, hosts),
          "replication_wide_sizes_bytes": reduction.received_bytes(wide, hosts)}
