"""Helpers and fixtures shared by test_restore_plan.py and test_restore_plan_topologies.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from hypothesis import strategies as st

from orbax_mtc import step_listing as rp


def inv(own_steps: Collection[int] = (),
        copies: Collection[tuple[int, int]] = ()) -> rp.NodeInventory:
  return rp.NodeInventory(frozenset(own_steps), frozenset(copies))


def own(rank: int) -> rp.Source:
  return rp.Source(rp.OWN, rank)


def twin(holder: int) -> rp.Source:
  return rp.Source(rp.TWIN, holder)


def peer(holder: int) -> rp.Source:
  return rp.Source(rp.PEER, holder)


STEPS = (10, 20)


DATA2_FSDP2 = [0, 1, 0, 1]  # replicas {0,1}, {2,3}; twins 0<->2, 1<->3


FSDP4 = [0, 1, 2, 3]  # one replica: nobody has a twin


def full_cluster(groups: Sequence[int], holders: dict[int, list[int]],
                 steps: Collection[int] = STEPS) -> list[rp.NodeInventory]:
  """Every node owns `steps`; holders[h] = ranks whose data node h holds a copy of."""
  return [inv(steps, {(src, s) for src in holders.get(h, []) for s in steps})
          for h in range(len(groups))]


def wipe(inventories: list[rp.NodeInventory], *ranks: int) -> list[rp.NodeInventory]:
  out = list(inventories)
  for r in ranks:
    out[r] = inv()
  return out


TWIN_COPIES = {0: [2], 2: [0], 1: [3], 3: [1]}  # peers = twins


RING = {1: [0], 2: [1], 3: [2], 0: [3]}  # node i+1 holds node i's copy


MAX_STEP = 7


@dataclasses.dataclass(frozen=True)
class Cluster:
  inventories: tuple[rp.NodeInventory, ...]
  groups: tuple[int, ...]
  excluded: frozenset[tuple[int, int, int]]
  persistent: tuple[int, ...]
  requested: int | None


step_st = st.integers(0, MAX_STEP)


@st.composite
def random_inventories(draw, n: int) -> list[rp.NodeInventory]:
  """Arbitrary own steps and copies (copies may name the holder itself)."""
  return [inv(draw(st.frozensets(step_st, max_size=6)),
              draw(st.frozensets(st.tuples(st.integers(0, n - 1), step_st), max_size=8)))
          for _ in range(n)]


@st.composite
def realistic_inventories(draw, n: int, groups: Sequence[int]) -> list[rp.NodeInventory]:
  """Steps saved cluster-wide, copies on peers, then some nodes wiped or missing steps."""
  saved = draw(st.frozensets(step_st, min_size=1, max_size=4))
  peers_of = [draw(st.lists(st.integers(0, n - 1).filter(lambda p, r=r: p != r or n == 1),
                            max_size=2, unique=True)) for r in range(n)]
  has_twin = [any(groups[h] == groups[r] for h in range(n) if h != r) for r in range(n)]
  invs = []
  for holder in range(n):
    held = {(src, s) for src in range(n) if holder in peers_of[src] for s in saved}
    own_steps = set(saved)
    if draw(st.booleans()):  # some damage: lost steps, lost copies, or a wipe
      own_steps -= draw(st.frozensets(st.sampled_from(sorted(saved))))
      if held:
        held -= draw(st.frozensets(st.sampled_from(sorted(held))))
      if draw(st.integers(0, 3)) == 0:
        own_steps, held = set(), set()
    if has_twin[holder] and draw(st.booleans()):
      held = set()  # twins are free peers: no copies needed
    invs.append(inv(own_steps, held))
  return invs


@st.composite
def clusters(draw) -> Cluster:
  n = draw(st.integers(1, 8))
  if draw(st.booleans()):  # pure FSDP: no twins, peers matter
    groups = tuple(range(n))
  else:
    n_groups = draw(st.integers(1, n))
    groups = tuple(draw(st.lists(st.integers(0, n_groups - 1), min_size=n, max_size=n)))
  if draw(st.booleans()):
    invs = draw(realistic_inventories(n, groups))
  else:
    invs = draw(random_inventories(n))
  # Exclusions: mostly sources that exist, plus a few arbitrary ones.
  real = sorted({(r, r, s) for r, i in enumerate(invs) for s in i.own_steps}
                | {(h, d, s) for h, i in enumerate(invs) for d, s in i.copies}
                | {(h, d, s) for h, i in enumerate(invs) for d in range(n)
                   if groups[d] == groups[h] for s in i.own_steps})
  excluded = set(draw(st.frozensets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                                              step_st), max_size=2)))
  if real:
    excluded |= draw(st.frozensets(st.sampled_from(real), max_size=4))
  persistent = tuple(draw(st.lists(step_st, max_size=3)))
  requested = draw(st.none() | step_st)
  return Cluster(tuple(invs), groups, frozenset(excluded), persistent, requested)


def valid_holders(c: Cluster, step: int, dest: int) -> dict[str, list[int]]:
  """Brute force: every holder that can serve `dest` at `step`, by kind."""
  invs, groups, bad = c.inventories, c.groups, c.excluded
  out: dict[str, list[int]] = {rp.OWN: [], rp.TWIN: [], rp.PEER: []}
  if step in invs[dest].own_steps and (dest, dest, step) not in bad:
    out[rp.OWN].append(dest)
  for h, i in enumerate(invs):
    if h == dest or (h, dest, step) in bad:
      continue
    if groups[h] == groups[dest] and step in i.own_steps and (h, h, step) not in bad:
      out[rp.TWIN].append(h)
    if (dest, step) in i.copies:
      out[rp.PEER].append(h)
  return out


def plan_of(c: Cluster) -> rp.RestorePlan:
  return rp.plan_restore(list(c.inventories), list(c.persistent), c.requested,
                         shard_groups=list(c.groups), excluded=set(c.excluded))


def check_source(c: Cluster, step: int, dest: int, src: rp.Source) -> None:
  inv_dest, inv_holder = c.inventories[dest], c.inventories[src.holder]
  assert 0 <= src.holder < len(c.inventories)
  if src.kind == rp.OWN:
    assert src.holder == dest
    assert step in inv_dest.own_steps and (dest, dest, step) not in c.excluded
  elif src.kind == rp.TWIN:
    assert src.holder != dest and c.groups[src.holder] == c.groups[dest]
    assert step in inv_holder.own_steps
    assert (src.holder, src.holder, step) not in c.excluded
    assert (src.holder, dest, step) not in c.excluded
  else:
    assert src.kind == rp.PEER
    assert src.holder != dest
    assert (dest, step) in inv_holder.copies
    assert (src.holder, dest, step) not in c.excluded
