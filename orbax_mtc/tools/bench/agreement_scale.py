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

The restore agreement (inventory, cover, reports) is still an all-gather of `RestoreRecord`
rows: its figures are the same before and after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_mtc import agreement, reduction, save_census
from orbax_mtc import step_listing as listing
from orbax_mtc.agreement import Inventory, SaveRecord, Status
from orbax_mtc.peers import send_census

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
  restore_row = 8 * agreement.row_size(agreement.RestoreRecord)
  out["restore_row_bytes"] = restore_row
  out["restore_before_bytes"] = out["restore_after_bytes"] = reduction.gathered_bytes(
      restore_row, hosts)
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
