"""Elastic restore time beside a same-topology RAM restore and a persistent restore of the
same step, in one run.

One job of 4 processes (1 CPU device each, mesh data=2 x model=2) saves steps 0..10: RAM every
2 steps, persistent every 10, so step 10 is in both tiers. Then, in turns, for --reps rounds,
each from a fresh copy of the saved folders:

  same-topology  4 processes restore step 10 from their own RAM folders;
  elastic        2 processes (two hosts gone) rebuild step 10 from RAM: their own folders
                 and the peer copies of the two lost hosts;
  persistent     the same 2 processes with empty RAM restore step 10 from the persistent tier.

Each restore is checked bit for bit; its time is `mgr.last_restore.seconds`, the slowest
process's. Run from the repository root:

  python benchmarks/elastic_restore.py --rows 65536 --reps 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import mp_helpers  # noqa: E402
from mp_helpers import mp_events  # noqa: E402

ARGS = ["--local-interval", "2", "--local-keep", "2", "--persistent-interval", "10",
        "--shape-axes", "2,2", "--replicas", "2"]


def _run(command, procs, root, persistent, rows):
  result, out = mp_helpers.run_job([*command, "--persistent-dir", str(persistent), "--rows",
                                    str(rows), *ARGS], procs, root, devices=1, timeout_s=600)
  mp_helpers.assert_ok(result, out)
  return out


def _restore(kind: str, saved: pathlib.Path, persistent: pathlib.Path, rows: int) -> float:
  root = mp_helpers.new_root(f"bench-elastic-{kind}")
  procs = 4 if kind == "same-topology" else 2
  try:
    for node in range(procs):
      if kind == "persistent":
        (root / f"node{node}").mkdir(parents=True)
      else:
        shutil.copytree(saved / f"node{node}", root / f"node{node}", symlinks=True)
    out = _run(["restore", "--explicit-args"], procs, root, persistent, rows)
    results = mp_events.parse_results(out.lines)
    tier = {"same-topology": "local"}.get(kind, kind)
    for node, fields in results.items():
      if fields["ok"] != "1" or (fields["step"], fields["tier"]) != ("10", tier):
        raise SystemExit(f"{kind}: node {node} restored {fields}")
    return max(float(fields["seconds"]) for fields in results.values())
  finally:
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=65536,
                      help="rows of params/w per data index (256 bytes each)")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  saved = mp_helpers.new_root("bench-elastic-saved")
  persistent = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
  try:
    _run(["save", "--steps", "11"], 4, saved, persistent, args.rows)
    times: dict[str, list[float]] = {"same-topology": [], "elastic": [], "persistent": []}
    for _ in range(args.reps):
      for kind in times:
        times[kind].append(_restore(kind, saved, persistent, args.rows))
  finally:
    shutil.rmtree(saved, ignore_errors=True)
    shutil.rmtree(persistent.parent, ignore_errors=True)
  state_mib = (2 * args.rows * 64 * 4) / 2**20
  med = {k: statistics.median(v) for k, v in times.items()}
  lines = [
      f"# Elastic restore of step 10 ({state_mib:.0f} MiB of params/w; 4 processes saved it)",
      "",
      "| restore | processes | median s | runs (s) | vs elastic |",
      "|---|---|---|---|---|",
  ]
  for kind, procs in (("same-topology", 4), ("elastic", 2), ("persistent", 2)):
    runs = ", ".join(f"{t:.3f}" for t in times[kind])
    lines.append(f"| {kind} | {procs} | {med[kind]:.3f} | {runs} | "
                 f"{med[kind] / med['elastic']:.2f}x |")
  lines += ["", f"Command: `python benchmarks/elastic_restore.py --rows {args.rows} --reps "
            f"{args.reps}`. Time: `mgr.last_restore.seconds`, the slowest process; every "
            "restore checked bit for bit."]
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "elastic-restore.md").write_text("\n".join(lines) + "\n")
  (args.out / "elastic-restore.json").write_text(json.dumps(
      {"rows": args.rows, "reps": args.reps, "seconds": times}, indent=1))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
