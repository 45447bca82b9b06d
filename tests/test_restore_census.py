"""The restore planning's reductions (restore/census.py) give the all-gather's plan: randomized
clusters, faults (excluded and dropped folders) and other process counts included, and the
bytes per process pinned as a function of the host count."""

from __future__ import annotations

import random

import numpy as np
import pytest

from orbax_mtc import reduction
from orbax_mtc.restore import census
from orbax_mtc.restore import plan as restore_plan
from orbax_mtc.restore.plan import FolderRef, HostReport


def _reducer(mines: list[census.Mine], rounds: list[reduction.Parts]):
  def reduce(rnd: reduction.Round) -> reduction.Parts:
    out = reduction.combine(rnd.contribute(m, p) for p, m in enumerate(mines))
    rounds.append(out)
    return out
  return reduce


def _new_plan(reports, covers, *, requested_step=None, min_step=None, excluded=(), dropped=()):
  """The executor's choice, simulated over every process (each reads the layout alike)."""
  mines = [census.holdings(r, p, requested_step=requested_step, min_step=min_step,
                           excluded=excluded, dropped=dropped) for p, r in enumerate(reports)]
  rounds: list[reduction.Parts] = []
  reduce = _reducer(mines, rounds)

  def facts(p, agreed):
    return [bool(mines[p].get(a.save)) for a in agreed], [covers(a) for a in agreed]
  chosen, cover, _ = census.choose(mines[0], 0, reduce, facts)
  if chosen is None:
    return None, rounds
  servers = census.agree_servers(mines[0], 0, chosen, cover, len(reports), reduce, [])
  return restore_plan.ElasticPlan(chosen.step, chosen.count, chosen.digest, servers), rounds


def _random_cluster(rng: random.Random) -> list[HostReport]:
  processes = rng.randint(1, 12)
  saves = [(s, rng.choice([processes, rng.randint(1, 12)]), rng.choice([7, 9]))
           for s in rng.sample(range(1, 40), rng.randint(1, 4))]
  reports = []
  for _ in range(processes):
    kinds = {restore_plan.OWN: [], restore_plan.COPY: [], restore_plan.ASIDE: []}
    for step, count, digest in saves:
      for kind in kinds:
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
          kinds[kind].append(FolderRef(step, count, rng.randrange(count + 1), digest))
    reports.append(HostReport(own=tuple(kinds[restore_plan.OWN]),
                              copies=tuple(kinds[restore_plan.COPY]),
                              aside=tuple(kinds[restore_plan.ASIDE])))
  return reports


@pytest.mark.parametrize("seed", range(300))
def test_the_reductions_choose_the_save_and_servers_the_all_gather_chose(seed):
  rng = random.Random(seed)
  reports = _random_cluster(rng)
  lenient, salt = rng.random() < 0.7, rng.randrange(1 << 16)

  def covers(candidate) -> bool:  # a layout's verdict, from the available ranks alone
    held = len(candidate.available)
    return held == candidate.count or (lenient and 2 * held >= candidate.count
                                       and hash((candidate.step, candidate.count, salt)) % 3 > 0)

  steps = sorted({ref.step for r in reports for _, refs in r.kinds() for ref in refs})
  kwargs = {}
  if steps and rng.random() < 0.3:
    kwargs["requested_step"] = rng.choice(steps)
  elif steps and rng.random() < 0.3:
    kwargs["min_step"] = rng.choice(steps)
  if rng.random() < 0.4:  # folders found damaged by an earlier attempt
    kwargs["excluded"] = {(p, ref.rank, ref.step) for p, r in enumerate(reports)
                          for _, refs in r.kinds() for ref in refs if rng.random() < 0.2}
  dropped = set()
  if rng.random() < 0.2:  # every folder of one save failed without a culprit named
    refs = [(p, ref) for p, r in enumerate(reports) for _, refs in r.kinds() for ref in refs]
    if refs:
      _, ref = rng.choice(refs)
      dropped = {(ref.step, ref.count, ref.digest)}
  old_excluded = set(kwargs.get("excluded", ()))
  for p, r in enumerate(reports):  # the old executor excluded every holder of that save
    old_excluded |= {(p, ref.rank, ref.step) for _, refs in r.kinds() for ref in refs
                     if (ref.step, ref.count, ref.digest) in dropped}
  old = restore_plan.plan(reports, covers, **{**kwargs, "excluded": old_excluded})
  new, _ = _new_plan(reports, covers, dropped=dropped, **kwargs)
  assert new == old


def test_servers_replay_the_load_spreading_of_copies_held_twice():
  # Ranks 2 and 3 lost their own folders; processes 0 and 1 each hold copies of both.
  reports = [HostReport(own=(FolderRef(5, 4, 0, 1),),
                        copies=(FolderRef(5, 4, 2, 1), FolderRef(5, 4, 3, 1))),
             HostReport(own=(FolderRef(5, 4, 1, 1),),
                        copies=(FolderRef(5, 4, 2, 1), FolderRef(5, 4, 3, 1)))]
  new, rounds = _new_plan(reports, lambda c: len(c.available) == c.count)
  assert new == restore_plan.plan(reports, lambda c: len(c.available) == c.count)
  assert [(r, p) for r, p, _ in new.servers] == [(0, 0), (1, 1), (2, 0), (3, 1)]
  assert len(rounds) == 6  # saves, tiers, cover, servers, the next holders, none left


def _ring(hosts: int, lost: int, replaced: bool, steps=(1000, 1100, 1200)):
  """A job of `hosts` with a ring peer copy each after `lost` hosts died: the survivors alone
  (renumbered), or with the lost ones replaced by empty hosts. Returns the reports and the
  ranks whose one holder is not the process of their index."""
  gone = set(range(1, hosts, hosts // lost))
  reports, process_of = [], {}
  for h in range(hosts):
    if h in gone:
      if replaced:
        reports.append(HostReport())
      continue
    process_of[h] = len(reports)
    reports.append(HostReport(own=tuple(FolderRef(s, hosts, h, 3) for s in steps),
                              copies=tuple(FolderRef(s, hosts, (h - 1) % hosts, 3)
                                           for s in steps)))
  server = {r: process_of[r] if r in process_of else process_of[(r + 1) % hosts]
            for r in range(hosts)}
  return reports, sum(p != r for r, p in server.items())


@pytest.mark.parametrize("replaced", [False, True])
@pytest.mark.parametrize("hosts", [8, 100, 1000])
def test_bytes_per_process_as_a_function_of_the_host_count(hosts, replaced):
  reports, coded = _ring(hosts, max(1, hosts // 100), replaced)
  plan, rounds = _new_plan(reports, lambda c: len(c.available) == c.count)
  assert plan is not None and plan.step == 1200
  assert plan == restore_plan.plan(reports, lambda c: len(c.available) == c.count)
  processes = len(reports)
  # saves 640 B, tiers 1 B per saved rank, cover 20 B, servers `width` bytes per rank whose
  # holder is not the process of its index (most ranks after a renumbering; the lost ones
  # when they were replaced).
  vectors = [r.nbytes for r in rounds]
  assert vectors == [640, hosts, 20, census.width(processes) * coded]
  assert vectors == census.planning_vectors(hosts, processes, coded)
  assert census.planning_bytes(hosts, processes, coded) == sum(
      reduction.received_bytes(v, processes) for v in vectors)
  if replaced:
    assert coded == max(1, hosts // 100)


def test_planning_stays_under_a_mebibyte_at_100000_hosts():
  # Renumbered survivors: nearly every rank coded in 3 bytes; replaced hosts: the lost ones.
  assert census.planning_bytes(100_000, 99_000, coded=99_000) < 800_000
  assert census.planning_bytes(100_000, 100_000, coded=1000) < 210_000


def test_width_grows_by_bytes_of_the_process_index():
  assert [census.width(n) for n in (1, 255, 256, 65535, 65536, 100_000)] == [1, 1, 2, 2, 3, 3]
  agreed = census.Agreed(1, 3, 0, np.array([3, 0, 1]), np.array([True, False, False]))
  assert agreed.available == {0, 2} and agreed.current == 1


def test_the_saves_round_hashes_again_until_every_save_is_named():
  saves = [(1000 + s, 4 + s % 3, 0xFFFFFFFF - s) for s in range(100)]  # more than 16 buckets
  mines = [{save: {0: (restore_plan.OWN,)} for save in saves[p::3]} for p in range(3)]
  rounds: list[reduction.Parts] = []
  found = census.agree_saves(mines[0], 0, _reducer(mines, rounds), [])
  assert found == sorted(saves, key=lambda s: (-s[0], s[1], s[2]))
  assert len(rounds) >= 2 and rounds[0].nbytes == 640


def test_a_restore_census_names_the_steps_asked_for_when_they_differ():
  from orbax_mtc import save_census
  from orbax_mtc.agreement import SaveRecord

  records = [SaveRecord(step=s) for s in (-1, 7, 7)]

  def reduce(rnd):
    return reduction.combine(rnd.contribute(r, p) for p, r in enumerate(records))
  answer = save_census.agree(records[0], 0, 3, None, [], [], reduce, restoring=True)
  assert answer.steps_error == (
      "restore() was called with different steps on different processes: process 0: None, "
      "process 1 and 1 other process(es): 7. Every process must restore the same step; use "
      "step = mgr.latest_step(), which is the same on every process.")


def test_a_listing_cuts_its_tiers_rounds_to_a_bounded_size():
  """The listing (`elastic_steps`) examines every unlisted save: in rounds of at most
  TIERS_ROUND_BYTES, or one save where one is larger, in order, none lost or repeated."""
  saves = [(9, 3, 1), (9, 5, 2), (8, 4, 3), (7, 2, 4)]
  assert census.tiers_batches(saves, budget=8) == [((9, 3, 1), (9, 5, 2)), ((8, 4, 3), (7, 2, 4))]
  assert census.tiers_batches(saves, budget=4) == [((9, 3, 1),), ((9, 5, 2),), ((8, 4, 3),),
                                                   ((7, 2, 4),)]
  assert census.tiers_batches([]) == []
  # 62 saves of 100,000 hosts each (the most a listing examines): two a round, about
  # 0.4 MiB received per process; 62 saves of 1,000 hosts share one round.
  hosts = 100_000
  big = [(s, hosts, s) for s in range(62)]
  batches = census.tiers_batches(big)
  assert [len(b) for b in batches] == [2] * 31
  assert max(reduction.received_bytes(sum(s[1] for s in b), hosts) for b in batches) < 1 << 20
  assert census.tiers_batches([(1, 10 * hosts, 1)]) == [((1, 10 * hosts, 1),)]
  small = census.tiers_batches([(s, 1_000, s) for s in range(62)])
  assert [s for b in small for s in b] == [(s, 1_000, s) for s in range(62)]
  assert len(small) == 1 and sum(s[1] for s in small[0]) <= census.TIERS_ROUND_BYTES
