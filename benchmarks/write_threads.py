"""The RAM tier's step write with one writer thread against several, same run, files reused.

  python benchmarks/write_threads.py --mib 1024 --threads 1 2 --reps 5 [--root /dev/shm/wt]

Each repetition writes one step per thread count, alternating (LocalTier.write of a float32
state, the checksums included, the previous step's file reused as in steady state); the first
repetition warms the files and is not counted. Prints the median seconds and GB/s per count.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=1024)
  parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--root", default="/dev/shm/orbax-mtc-write-threads")
  args = parser.parse_args()
  root = Path(args.root)
  shutil.rmtree(root, ignore_errors=True)
  state = {"w": np.random.default_rng(0).random(args.mib << 18, dtype=np.float32)}
  tiers = {n: LocalTier(root / f"threads-{n}", max_to_keep=1, write_threads=n)
           for n in args.threads}
  seconds: dict[int, list[float]] = {n: [] for n in args.threads}
  try:
    for tier in tiers.values():
      tier.prepare()
    step = 0
    for rep in range(args.reps + 1):
      for n, tier in tiers.items():
        step += 1
        staged = stage(step, {"state": state}, {}, default_item=False)
        began = time.perf_counter()
        tier.write(staged, 0, 1)
        if rep:
          seconds[n].append(time.perf_counter() - began)
  finally:
    for tier in tiers.values():
      tier.close()
    shutil.rmtree(root, ignore_errors=True)
  for n in args.threads:
    median = statistics.median(seconds[n])
    print(f"{n} writer thread(s): {median:.3f} s median, {(args.mib << 20) / median / 1e9:.2f} "
          f"GB/s ({', '.join(f'{s:.3f}' for s in seconds[n])})")


if __name__ == "__main__":
  main()
