"""Goodput chart from `orbax-mtc bench goodput` results: one pair of bars per seed.

  python benchmarks/plot_goodput.py benchmarks/results/goodput.json \
      benchmarks/results/goodput-seeds-3-5.json --out benchmarks/results/goodput.png
"""

from __future__ import annotations

import argparse
import json
import pathlib


def seeds_and_goodput(paths: list[pathlib.Path]) -> list[tuple[int, float, float]]:
  """(seed, orbax-mtc goodput, plain Orbax goodput) of every run in the result files."""
  out = []
  for path in paths:
    for run in json.loads(path.read_text())["runs"]:
      out.append((int(run["seed"]), run["mtc"]["goodput"], run["orbax"]["goodput"]))
  return sorted(out)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", nargs="+", type=pathlib.Path, help="goodput.json files")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="PNG to write")
  args = parser.parse_args(argv)
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = seeds_and_goodput(args.results)
  seeds = [seed for seed, _, _ in rows]
  width = 0.38
  fig, ax = plt.subplots(figsize=(7, 3.2))
  for shift, column, label, color in ((-width / 2, 1, "orbax-mtc", "C0"),
                                      (width / 2, 2, "plain Orbax", "C1")):
    values = [100 * row[column] for row in rows]
    bars = ax.bar([i + shift for i in range(len(rows))], values, width, label=label,
                  color=color)
    ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
  ax.set_xticks(range(len(rows)), [f"seed {s}" for s in seeds])
  ax.set_ylabel("goodput (%)")
  ax.set_ylim(0, 110)
  ax.set_title("Goodput of one job under SIGTERM, SIGKILL and node loss", fontsize=10)
  ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.32), ncol=2, frameon=False)
  ax.grid(True, axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  plt.close(fig)
  print(args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
