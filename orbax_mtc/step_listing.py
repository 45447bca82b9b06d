"""Which RAM steps the step lists offer (`all_steps()`), from the inventories every agreement
carries: a step every node can get from its own folder, a twin's or a peer's copy (pure).

The restore itself plans over saved tiles (`restore.plan`), which covers everything this
module lists and more (other layouts, permuted ranks); this stays the cheap, agreement-free
listing that each save's agreement keeps current.

Inputs are inventories gathered from every process (its own committed steps and the peer copies
it holds) plus, per process, an id of the set of shards it needs (equal ids: data-parallel twins
that hold identical shards). No I/O and no JAX here, so every case can be tested exhaustively.

For one step, each node's data comes from, in order of preference:
  own   its own step folder;
  twin  the own folder of a node that holds exactly the same shards;
  peer  a copy of its step held by one of its peers.
A step is a candidate only when every node has a source. Among several holders the one with the
fewest transfers already assigned wins (then the lowest rank), so twins share the sending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

LOCAL = "local"
PERSISTENT = "persistent"
NONE = "none"

OWN, TWIN, PEER = "own", "twin", "peer"

@dataclasses.dataclass(frozen=True)
class NodeInventory:
  """What one node can serve: its own committed steps and complete peer copies it holds.

  Attributes:
    own_steps: Steps committed in the node's own folder.
    copies: (source rank, step) of every complete peer copy the node holds.
  """

  own_steps: frozenset[int] = frozenset()
  copies: frozenset[tuple[int, int]] = frozenset()  # (source rank, step)


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one node's data for a step comes from.

  Attributes:
    kind: `OWN`, `TWIN` or `PEER`.
    holder: Rank of the process that reads the bytes.
  """

  kind: str  # OWN, TWIN or PEER
  holder: int  # the process that reads the bytes


@dataclasses.dataclass(frozen=True)
class Assembly:
  """How the cluster assembles one step: a source for every process (index = rank).

  Attributes:
    step: The step being assembled.
    sources: Per rank, the `Source` of its data.
  """

  step: int
  sources: tuple[Source, ...]

  @property
  def transfers(self) -> tuple[tuple[int, int, str], ...]:
    """(holder, destination, kind) for every node that gets its data from elsewhere."""
    return tuple((s.holder, dest, s.kind) for dest, s in enumerate(self.sources)
                 if s.kind != OWN)

  @property
  def recovered(self) -> tuple[int, ...]:
    """Ranks that get their data from another node (twin or peer), ascending."""
    return tuple(dest for dest, s in enumerate(self.sources) if s.kind != OWN)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Candidates in the order they are tried: RAM assemblies newest first, then persistent.

  Attributes:
    candidates: RAM assemblies, newest step first.
    persistent_step: The persistent step to fall back to, or None if there is none.
  """

  candidates: tuple[Assembly, ...]
  persistent_step: int | None

  @property
  def local_candidates(self) -> tuple[int, ...]:
    """Steps of the RAM candidates, newest first."""
    return tuple(a.step for a in self.candidates)

  @property
  def empty(self) -> bool:
    """True if there is neither a RAM candidate nor a persistent step."""
    return not self.candidates and self.persistent_step is None


def assemble(step: int, inventories: Sequence[NodeInventory],
             shard_groups: Sequence[int] | None = None,
             excluded: Collection[tuple[int, int, int]] = ()) -> Assembly | None:
  """Chooses a source for every node at `step`.

  `excluded` holds (holder, destination, step) sources that failed (bad checksum, unreadable):
  they are never chosen again. A node's own folder is excluded as (rank, rank, step).

  Args:
    step: The step to assemble.
    inventories: Per rank, what that node holds.
    shard_groups: Per rank, an id of the set of shards it needs (equal ids: twins); None
      makes every rank its own group (no twins).
    excluded: (holder, destination, step) sources never to choose.

  Returns:
    The `Assembly`, or None if some node has no source.

  Raises:
    ValueError: If `shard_groups` does not have one entry per inventory.
  """
  n = len(inventories)
  groups = list(shard_groups) if shard_groups is not None else list(range(n))
  if len(groups) != n:
    raise ValueError(f"{len(groups)} shard groups for {n} inventories")
  bad = set(excluded)
  load = [0] * n
  sources: list[Source] = []
  for dest in range(n):
    if step in inventories[dest].own_steps and (dest, dest, step) not in bad:
      sources.append(Source(OWN, dest))
      continue
    options: list[tuple[int, int, int, int]] = []  # (kind order, load, holder) sort key
    for holder in range(n):
      if holder == dest or (holder, dest, step) in bad:
        continue
      inv = inventories[holder]
      if groups[holder] == groups[dest] and step in inv.own_steps \
          and (holder, holder, step) not in bad:
        options.append((0, load[holder], holder, 0))
      elif (dest, step) in inv.copies:
        options.append((1, load[holder], holder, 1))
    if not options:
      return None
    _, _, holder, kind = min(options)
    load[holder] += 1
    sources.append(Source(TWIN if kind == 0 else PEER, holder))
  return Assembly(step, tuple(sources))


def plan_restore(inventories: Sequence[NodeInventory | Collection[int]],
                 persistent_steps: Sequence[int], requested_step: int | None, *,
                 shard_groups: Sequence[int] | None = None,
                 excluded: Collection[tuple[int, int, int]] = ()) -> RestorePlan:
  """Plans a restore: RAM assemblies (newest first) and the persistent fallback.

  With `requested_step`, only that step is a candidate in either tier. A RAM step older than the
  newest persistent step would lose work, so it is not a candidate. Plain step sets are accepted
  as inventories (own steps, no copies).

  Args:
    inventories: Per rank, a `NodeInventory` or a plain collection of its own steps.
    persistent_steps: Steps committed to the persistent tier.
    requested_step: The only step to consider, or None for the newest available.
    shard_groups: Per rank, an id of the set of shards it needs (see `assemble`).
    excluded: (holder, destination, step) sources that failed (see `assemble`).

  Returns:
    The `RestorePlan`.

  Raises:
    ValueError: If `shard_groups` does not have one entry per inventory (from `assemble`).
  """
  invs = [inv if isinstance(inv, NodeInventory) else NodeInventory(frozenset(inv))
          for inv in inventories]
  persistent = sorted({int(s) for s in persistent_steps})
  if requested_step is not None:
    persistent = [s for s in persistent if s == requested_step]
  persistent_step = persistent[-1] if persistent else None
  steps: set[int] = set()
  for inv in invs:
    steps |= inv.own_steps
    steps |= {s for _, s in inv.copies}
  if requested_step is not None:
    steps &= {requested_step}
  if persistent_step is not None:
    steps = {s for s in steps if s >= persistent_step}
  candidates = []
  for step in sorted(steps, reverse=True):
    assembly = assemble(step, invs, shard_groups, excluded) if invs else None
    if assembly is not None:
      candidates.append(assembly)
  return RestorePlan(candidates=tuple(candidates), persistent_step=persistent_step)


def common_steps(inventories: Sequence[Collection[int]]) -> list[int]:
  """Steps that every process holds in its own folder.

  Args:
    inventories: Per rank, the steps in its own folder.

  Returns:
    The steps common to all inventories, newest first; empty if there are no inventories.
  """
  if not inventories:
    return []
  shared = set.intersection(*(set(inv) for inv in inventories))
  return sorted(shared, reverse=True)


def restorable_steps(inventories: Sequence[NodeInventory],
                     shard_groups: Sequence[int] | None = None) -> list[int]:
  """RAM steps the whole cluster can assemble (own folder, twin or peer copy).

  This is what `all_steps()` lists besides the persistent steps.

  Args:
    inventories: Per rank, what that node holds.
    shard_groups: Per rank, an id of the set of shards it needs (see `assemble`); None makes
      every rank its own group.

  Returns:
    The assemblable steps, oldest first.
  """
  n = len(inventories)
  groups = list(shard_groups) if shard_groups is not None else list(range(n))
  holders: dict[int, set[int]] = {}  # step -> nodes holding it in their own folder
  copied: dict[int, set[int]] = {}  # step -> nodes whose copy some node holds
  for node, inv in enumerate(inventories):
    for step in inv.own_steps:
      holders.setdefault(step, set()).add(node)
    for source, step in inv.copies:
      if source != node:  # a node's copy of itself dies with it
        copied.setdefault(step, set()).add(source)
  out = []
  # Linear in the nodes per step (what `assemble` would find, without choosing holders):
  # the answer of every save's agreement, so it must stay cheap on thousands of hosts.
  for step in sorted(set(holders) | set(copied)):
    own, copies = holders.get(step, set()), copied.get(step, set())
    served_groups = {groups[node] for node in own}
    if all(node in own or node in copies or groups[node] in served_groups for node in range(n)):
      out.append(step)
  return out
