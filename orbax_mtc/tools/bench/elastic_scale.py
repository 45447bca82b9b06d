"""`orbax-mtc bench elastic-scale`: how an elastic restore's planning grows with the cluster.

  orbax-mtc bench elastic-scale --hosts 1000 10000 100000 --leaves 2000 --reps 3 --out DIR

Pure computation on one core, no JAX and no I/O: for each host count H, the inventory a
restart finds after a job of H hosts x 8 devices (mesh replica=2 x fsdp=4H: two data-parallel
replicas, one process per host) saved 3 RAM steps of `--leaves` leaves, each host also holding
a peer copy of its ring predecessor's folders, and then lost 1% of its hosts for good. The
survivors restart on their own mesh (replica=2 x fsdp=4H'). Measured (medians of `--reps`):

* report: each survivor's `HostReport.encode()` (largest and mean bytes), beside the fixed
  slot it travels in and what the restore agreement's all-gather hands each process;
* plan: decode every report, then `elastic_plan.plan` with coverage tested against the saved
  layout's distinct holder sets: the work every process does before a byte moves;
* layout: the saved layout's holder sets and one `TileIndex` per distinct leaf layout (leaves
  share a few shardings), once per save;
* pieces: one process's share of the byte ranges: for each of its 8 new shards of every leaf,
  the saved tiles giving its bytes (`pieces`) and the saved rank providing each (`provider`);
* agreement bytes: what each process receives per save agreement (before: an all-gather of
  `SaveRecord` rows; after: save_census's reductions, in steady state and while the lost
  hosts' replacements lack the steps) and per restore agreement (before: all-gathers of
  `RestoreRecord` and `CoverRecord` rows; after: the census with the step asked for and
  restore/census's planning rounds, on the survivors alone and with the lost hosts replaced;
  `agreement_scale`).

Writes elastic-scale.json, elastic-scale.md and elastic-scale.png (needs matplotlib,
`pip install 'orbax-mtc[bench]'`) under `--out`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orbax_mtc import agreement, row_codec, save_census
from orbax_mtc.restore import plan as elastic_plan
from orbax_mtc.restore.plan import Box, FolderRef, HostReport, TileIndex
from orbax_mtc.tools.bench import agreement_scale, output, plotting

DEVICES_PER_HOST = 8
REPLICAS = 2
STEPS = (1000, 1100, 1200)
DIGEST = 0x5EED1234
PLAN_BUDGET_S = 1.0
SCHEMA = "orbax-mtc/bench-elastic-scale/1"


@dataclasses.dataclass(frozen=True)
class _LeafLayout:
  """One distinct sharding of the saved state: its tiles and their holders (as a manifest
  lists them), and how a new mesh of `fsdp` positions cuts the same array."""

  name: str
  shape: tuple[int, ...]
  sharded_dim: int | None  # None: replicated on every device
  tiles: tuple[tuple[Box, tuple[int, ...]], ...]

  def targets(self, fsdp: int, position: int) -> Box:
    """The new shard at fsdp `position` of `fsdp` (uneven cuts: the new count need not
    divide the dimension)."""
    if self.sharded_dim is None:
      return tuple((0, n) for n in self.shape)
    n = self.shape[self.sharded_dim]
    box = [(0, size) for size in self.shape]
    box[self.sharded_dim] = (position * n // fsdp, (position + 1) * n // fsdp)
    return tuple(box)


def _layouts(hosts: int) -> list[_LeafLayout]:
  """A transformer-like state's distinct shardings: weights split by rows or by columns over
  fsdp (replicated across the two replicas), and small replicated leaves."""
  fsdp = hosts * DEVICES_PER_HOST // REPLICAS
  half = hosts // REPLICAS
  out = []
  for name, shape, dim in (("rows", (2 * fsdp, 16), 0), ("cols", (16, 2 * fsdp), 1),
                           ("rows-wide", (fsdp, 64), 0)):
    step = shape[dim] // fsdp
    tiles = []
    for j in range(fsdp):
      box = [(0, n) for n in shape]
      box[dim] = (j * step, (j + 1) * step)
      host = j // DEVICES_PER_HOST  # the replica-0 host holding fsdp position j
      tiles.append((tuple(box), (host, half + host)))
    out.append(_LeafLayout(name, shape, dim, tuple(tiles)))
  out.append(_LeafLayout("replicated", (64,), None, ((((0, 64),), tuple(range(hosts))),)))
  return out


def _leaf_kinds(leaves: int) -> list[int]:
  """Per leaf, its layout: 95% split weights in the three split layouts, 5% replicated."""
  return [3 if i % 20 == 19 else i % 3 for i in range(leaves)]


def _reports(hosts: int, lost: Sequence[int]) -> list[HostReport]:
  """The survivors' reports, in their new process order: own folders of every step and a
  peer copy of the ring predecessor's."""
  gone = set(lost)
  out = []
  for host in range(hosts):
    if host in gone:
      continue
    own = tuple(FolderRef(s, hosts, host, DIGEST) for s in STEPS)
    copies = tuple(FolderRef(s, hosts, (host - 1) % hosts, DIGEST) for s in STEPS)
    out.append(HostReport(own=own, copies=copies))
  return out


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  started = time.perf_counter()
  value = fn()
  return time.perf_counter() - started, value


def _layout_work(layouts: Sequence[_LeafLayout]) -> tuple[set[tuple[int, ...]], list[TileIndex]]:
  """Once per save: the holder sets, and a tile index per distinct leaf layout."""
  sets = elastic_plan.holder_sets(layout.tiles for layout in layouts)
  return sets, [TileIndex(index for index, _ in layout.tiles) for layout in layouts]


def _plan(encoded: Sequence[bytes], sets: set[tuple[int, ...]]
          ) -> elastic_plan.ElasticPlan | None:
  """What every process does with the gathered reports."""
  reports = elastic_plan.decode_reports(encoded)
  return elastic_plan.plan(reports, lambda c: elastic_plan.covered(sets, c.available))


def _pieces_of(chosen: elastic_plan.ElasticPlan, me: int, fsdp: int,
               leaves: Sequence[tuple[_LeafLayout, TileIndex]]) -> int:
  """One process's byte ranges: per leaf, per new shard, the tiles and their providers."""
  available = set(chosen.server_of())
  mine = set(chosen.served_by(me))
  # Devices in mesh order (replica-major): device d sits at fsdp position d % fsdp.
  positions = [d % fsdp for d in range(me * DEVICES_PER_HOST, (me + 1) * DEVICES_PER_HOST)]
  found = 0
  for layout, index in leaves:
    for box in dict.fromkeys(layout.targets(fsdp, p) for p in positions):
      for i, _ in elastic_plan.pieces(box, index):
        elastic_plan.provider(layout.tiles[i][1], mine, available, me)
        found += 1
  return found


def _streams(chosen: elastic_plan.ElasticPlan, processes: int, fsdp: int,
             layouts: Sequence[tuple[_LeafLayout, TileIndex]]) -> tuple[int, int, int]:
  """The exchange's streams: per receiving process, the other processes serving a saved rank
  that provides a tile of one of its new shards (every leaf layout once: leaves of one layout
  share their sources). Returns (streams, the most one process sends, the transfer's rounds:
  the most streams one process sends or receives)."""
  server_of = chosen.server_of()
  available = set(server_of)
  preferred = {rank for rank, _, kind in chosen.servers if kind != elastic_plan.COPY}
  served = {p: set() for p in range(processes)}
  for rank, process in server_of.items():
    served[process].add(rank)
  total, most_in, sent = 0, 0, collections.Counter()
  for me in range(processes):
    positions = [d % fsdp for d in range(me * DEVICES_PER_HOST, (me + 1) * DEVICES_PER_HOST)]
    sources = set()
    for layout, index in layouts:
      for box in dict.fromkeys(layout.targets(fsdp, p) for p in positions):
        for i, _ in elastic_plan.pieces(box, index):
          rank = elastic_plan.provider(layout.tiles[i][1], served[me], available, me, preferred)
          if rank is not None:
            sources.add(server_of[rank])
    sources.discard(me)
    total += len(sources)
    most_in = max(most_in, len(sources))
    sent.update(sources)
  most = max(sent.values(), default=0)
  return total, most, max(most, most_in)


def measure(hosts: int, leaves: int, reps: int, seed: int = 0) -> dict[str, Any]:
  """One host count's figures (seconds are medians over `reps`)."""
  if hosts < 2 * REPLICAS or hosts % REPLICAS:
    raise ValueError(f"--hosts must be even and at least {2 * REPLICAS}, got {hosts}")
  rng = random.Random(seed)
  lost = sorted(rng.sample(range(hosts), max(1, hosts // 100)))
  survivors = hosts - len(lost)
  layouts = _layouts(hosts)
  kinds = _leaf_kinds(leaves)
  encoded = [r.encode() for r in _reports(hosts, lost)]
  slot = agreement.ELASTIC_REPORT_BYTES
  if max(map(len, encoded)) > slot:
    raise AssertionError(f"a report of {max(map(len, encoded))} bytes exceeds its {slot}-byte slot")
  row_bytes = 8 * row_codec.row_size(agreement.RestoreRecord)
  me = survivors // 3  # a process away from the edges
  fsdp = survivors * DEVICES_PER_HOST // REPLICAS
  layout_s, plan_s, pieces_s = [], [], []
  chosen = None
  piece_count = 0
  for _ in range(reps):
    seconds, (sets, indexes) = _timed(functools.partial(_layout_work, layouts))
    layout_s.append(seconds)
    seconds, chosen = _timed(functools.partial(_plan, encoded, sets))
    plan_s.append(seconds)
    if chosen is None or chosen.step != STEPS[-1]:
      raise AssertionError(f"the plan should restore step {STEPS[-1]}, got {chosen}")
    seconds, piece_count = _timed(functools.partial(
        _pieces_of, chosen, me, fsdp, [(layouts[k], indexes[k]) for k in kinds]))
    pieces_s.append(seconds)
  return {
      "hosts": hosts, "devices": hosts * DEVICES_PER_HOST, "lost": len(lost),
      "survivors": survivors, "leaves": leaves,
      "tiles_per_split_leaf": len(layouts[0].tiles),
      "report_bytes_max": max(map(len, encoded)),
      "report_bytes_mean": statistics.fmean(map(len, encoded)),
      "report_slot_bytes": slot, "restore_row_bytes": row_bytes,
      "allgather_bytes_per_process": row_bytes * survivors,
      "plan_s": statistics.median(plan_s), "layout_s": statistics.median(layout_s),
      "pieces_s": statistics.median(pieces_s), "pieces_per_process": piece_count,
      "servers": len(chosen.servers), "copies_serving": sum(
          kind == elastic_plan.COPY for _, _, kind in chosen.servers),
      "plan_s_all": plan_s, "layout_s_all": layout_s, "pieces_s_all": pieces_s,
      **agreement_scale.save_agreement(hosts, lost),
      **agreement_scale.restore_agreement(
          hosts, lost, elastic_plan.decode_reports(encoded),
          lambda c: elastic_plan.covered(sets, c.available),
          *_streams(chosen, survivors, fsdp, list(zip(layouts, indexes, strict=True)))),
  }


def _size(n: float) -> str:
  for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                      ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n:.0f} B"


def markdown(rows: Sequence[dict[str, Any]], command: str) -> str:
  lines = [
      f"`{command}`", "",
      "| hosts (x8 devices) | lost | report bytes max / mean (slot) | its all-gather (before) "
      "| plan | layout (once per save) | pieces, one process |",
      "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['hosts']:,} | {r['lost']:,} | {r['report_bytes_max']} / "
        f"{r['report_bytes_mean']:.0f} ({r['report_slot_bytes']}) | "
        f"{_size(r['allgather_bytes_per_process'])} | {r['plan_s'] * 1e3:.0f} ms | "
        f"{r['layout_s'] * 1e3:.0f} ms | {r['pieces_s'] * 1e3:.0f} ms "
        f"({r['pieces_per_process']:,} pieces) |")
  lines += ["", f"Plan budget: {PLAN_BUDGET_S:.0f} s at 10,000 hosts. Each run: {rows[0]['leaves']:,} "
            f"leaves, {len(STEPS)} steps, 2 replicas, a ring peer copy per host, 1% of hosts lost "
            "(seeded), one core, medians of the repetitions."]
  lines += ["", "Bytes each process receives per agreement (all-gather: one row from every "
            "other process; all-reduce: 2 x vector x (P - 1) / P, a ring):", "",
            "| hosts | save, before (all-gather) | save, after: steady (rounds) "
            "| save, after: 1% replaced (rounds) |", "|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['hosts']:,} | {_size(r['save_before_bytes'])} | {_size(r['save_steady_bytes'])}"
        f" ({r['save_steady_rounds']}) | {_size(r['save_lost_bytes'])} "
        f"({r['save_lost_rounds']}) |")
  lines += ["", "After: a census of 4 x (21 + 5 x slots) + 4 x (11 + 4 x 16) bytes "
            f"({save_census.census_bytes(4)} B with this run's 4 agreed steps), plus, only "
            "while some nodes lack a step, one byte per node for each such step. Rounds "
            f"simulated in numpy and checked against the all-gather's answer; above "
            f"{agreement_scale.EXACT_UP_TO:,} hosts the coverage "
            "round's answer is computed in bulk."]
  lines += ["", "Restore (`restore(None)` after 1% of the hosts died), on the survivors alone "
            "(an elastic restore) and with the lost hosts replaced by empty ones:", "",
            "| hosts | survivors: before (all-gathers) | survivors: after (rounds) "
            "| replaced: before | replaced: after (rounds) |", "|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['hosts']:,} | {_size(r['restore_elastic_before_bytes'])} | "
        f"{_size(r['restore_elastic_bytes'])} ({r['restore_elastic_rounds']}) | "
        f"{_size(r['restore_replaced_before_bytes'])} | "
        f"{_size(r['restore_replaced_bytes'])} ({r['restore_replaced_rounds']}) |")
  lines += ["", "After: the census with the step asked for (plus, with replaced hosts, its "
            "coverage round: one byte per node and step they lack), then the saves round "
            "(640 B), one byte per saved rank for the newest step's save (tiers), 20 B (cover) "
            "and the servers: 1 to 3 bytes (the process index) per saved rank whose folder is "
            "not held by the process of its index (`census.planning_vectors`). Simulated "
            "process by process and checked against the all-gather's plan up to "
            f"{agreement_scale.EXACT_UP_TO:,} hosts; beyond, the planning rounds' sizes from "
            "the formula."]
  lines += ["", "The elastic restore's exchange (before: an all-gather of `ServeRecord` rows "
            "with one int64 size per ordered pair of processes; after: a status round, then "
            "bit_length(most) bits a process for how many streams it sends, bit_length(P - 1) "
            "bits a stream for its destination, and 4 bytes a transfer round for its largest "
            "stream; a stream carries its own length) and the build's outcome (before: "
            "an all-gather of `BuildRecord` rows; after: a statuses round of "
            "4 x (22 + P / 32) bytes when all went well):", "",
            "| hosts | streams | exchange, before | exchange, after | outcome, before "
            "| outcome, after |", "|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['hosts']:,} | {r['streams']:,} | {_size(r['serve_before_bytes'])} | "
        f"{_size(r['serve_after_bytes'])} | {_size(r['outcome_before_bytes'])} | "
        f"{_size(r['outcome_after_bytes'])} |")
  lines += ["", "Replication (one peer per host): at each save() call while a node still "
            "writes the step, then once per step for the bytes per copy edge:", "",
            "| hosts | before: all-gather, each call | after: status, each call "
            "| after: sizes, once per step (past 2 GiB a stream) |", "|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['hosts']:,} | {_size(r['replication_before_bytes'])} | "
        f"{_size(r['replication_status_bytes'])} | {_size(r['replication_sizes_bytes'])} "
        f"({_size(r['replication_wide_sizes_bytes'])}) |")
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
  """Plan time and agreement size against hosts; returns why not, if not."""
  plt = plotting.pyplot()
  if plt is None:
    return plotting.NOT_INSTALLED
  hosts = [r["hosts"] for r in rows]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  left.plot(hosts, [r["plan_s"] for r in rows], "C0-o", label="plan (every process)")
  left.plot(hosts, [r["pieces_s"] for r in rows], "C1-s", label="pieces (one process)")
  left.plot(hosts, [r["layout_s"] for r in rows], "C2-^", label="layout (once per save)")
  left.axhline(PLAN_BUDGET_S, color="k", linestyle=":", label="1 s")
  left.set(xscale="log", yscale="log", xlabel="hosts (8 devices each)", ylabel="seconds",
           title="Elastic restore planning, one core")
  left.legend(fontsize=8)
  right.plot(hosts, [r["report_bytes_max"] for r in rows], "C0-o", label="largest report")
  right.plot(hosts, [r["report_slot_bytes"] for r in rows], "k:", label="report slot")
  right.plot(hosts, [r["restore_elastic_before_bytes"] for r in rows], "C3-s",
             label="restore all-gathers (before), per process")
  right.plot(hosts, [r["restore_elastic_bytes"] for r in rows], "C5-D",
             label="restore reductions, survivors")
  right.plot(hosts, [r["restore_replaced_bytes"] for r in rows], "C5:D",
             label="restore reductions, 1% replaced")
  right.plot(hosts, [r["save_before_bytes"] for r in rows], "C4--^",
             label="save all-gather (before), per process")
  right.plot(hosts, [r["save_lost_bytes"] for r in rows], "C2-v",
             label="save reductions, 1% replaced")
  right.plot(hosts, [r["save_steady_bytes"] for r in rows], "C2:v",
             label="save reductions, steady")
  right.plot(hosts, [r["replication_wide_sizes_bytes"] for r in rows], "C1-.x",
             label="replication sizes, once per step")
  right.axhline(1 << 20, color="k", linestyle="--", linewidth=0.8, label="1 MiB")
  right.set(xscale="log", yscale="log", xlabel="hosts (8 devices each)", ylabel="bytes",
            title="Agreement size")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc bench elastic-scale",
      description="Plan time and agreement size of an elastic restore against host count "
      "(simulated inventories; pure computation on one core).")
  parser.add_argument("--hosts", type=int, nargs="+", default=[1000, 10000, 100000],
                      help="host counts, even (default: %(default)s)")
  parser.add_argument("--leaves", type=int, default=2000,
                      help="leaves of the saved state (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=3,
                      help="repetitions per host count (default: %(default)s)")
  parser.add_argument("--seed", type=int, default=0,
                      help="which hosts are lost (default: %(default)s)")
  parser.add_argument("--out", default="bench-out",
                      help="folder for elastic-scale.json/md/png (default: %(default)s)")
  output.add_json_flag(parser, SCHEMA)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.reps < 1 or args.leaves < 1:
    parser.error("--reps and --leaves must be at least 1")
  if any(h < 2 * REPLICAS or h % REPLICAS for h in args.hosts):
    parser.error(f"every --hosts value must be even and at least {2 * REPLICAS}")
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  rows = []
  for hosts in args.hosts:
    row = measure(hosts, args.leaves, args.reps, args.seed)
    print(f"{hosts:>7} hosts: plan {row['plan_s'] * 1e3:.0f} ms, layout "
          f"{row['layout_s'] * 1e3:.0f} ms, pieces {row['pieces_s'] * 1e3:.0f} ms, report "
          f"<= {row['report_bytes_max']} B, save agreement {row['save_before_bytes']} -> "
          f"{row['save_steady_bytes']} / {row['save_lost_bytes']} B, restore agreement "
          f"{row['restore_elastic_before_bytes']} -> {row['restore_elastic_bytes']} / "
          f"{row['restore_replaced_bytes']} B per process",
          file=sys.stderr)
    rows.append(row)
  command = "orbax-mtc bench elastic-scale " + " ".join(
      argv if argv is not None else sys.argv[1:])
  text = markdown(rows, command.strip())
  why_no_plot = plot(rows, out_dir / "elastic-scale.png")
  if why_no_plot:
    text += f"\nNo plot: {why_no_plot}.\n"
  document = {
      "schema": SCHEMA, "args": vars(args), "command": command.strip(), "rows": rows,
      "environment": {"python": platform.python_version(), "machine": platform.machine(),
                      "processor": platform.processor()}}
  (out_dir / "elastic-scale.md").write_text(text)
  (out_dir / "elastic-scale.json").write_text(json.dumps(document, indent=1))
  output.emit(args.json, document, text)
  return 0
