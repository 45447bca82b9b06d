"""The RAM tier's write of a step staged from CPU arrays (`device_copy`), copied straight into
the reused file's pages, against the same write through the host buffer, same run.

  python benchmarks/write_in_place.py --mib 1024 --reps 7 [--root /dev/shm/wip]

Each repetition writes one step per way, alternating (LocalTier.write, the checksums included,
the previous step's file reused as in steady state; the first two repetitions warm the files
and are not counted). "in place": `data_write.write_in_place`; "buffer": the views copied into
the tier's host buffer, then written to the file. Prints, per way, the median seconds of the
write and of the part that holds the arrays' buffers (a training step that donates the state
reuses them only after it), and the ratio in place / buffer.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from orbax_mtc.local import data_write
from orbax_mtc.local.staging import StagedStep, stage
from orbax_mtc.local.store import LocalTier

WAYS = ("in place", "buffer")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=1024)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--root", default="/dev/shm/orbax-mtc-write-in-place")
  args = parser.parse_args()
  root = Path(args.root)
  shutil.rmtree(root, ignore_errors=True)
  state = {"w": jax.random.uniform(jax.random.key(0), (args.mib << 18,), jnp.float32)}
  in_place = data_write.write_in_place
  let_go: list[float] = []  # when the arrays' buffers were let go of, per write

  def timed(method):
    def wrapper(self, *a, **k):
      try:
        return method(self, *a, **k)
      finally:
        let_go.append(time.perf_counter())
    return wrapper

  StagedStep.release = timed(StagedStep.release)
  StagedStep.copy_into = timed(StagedStep.copy_into)
  tiers = {way: LocalTier(root / way.replace(" ", "-"), max_to_keep=1) for way in WAYS}
  seconds: dict[str, list[float]] = {way: [] for way in WAYS}
  held: dict[str, list[float]] = {way: [] for way in WAYS}
  try:
    for tier in tiers.values():
      tier.prepare()
    step = 0
    for rep in range(args.reps + 2):
      for way, tier in tiers.items():
        step += 1
        data_write.write_in_place = in_place if way == "in place" else lambda *a, **k: None
        staged = stage(step, {"state": state}, {}, default_item=False, device_copy=True)
        let_go.clear()
        began = time.perf_counter()
        tier.write(staged, 0, 1)
        ended = time.perf_counter()
        if rep >= 2:
          seconds[way].append(ended - began)
          held[way].append(let_go[0] - began)
  finally:
    data_write.write_in_place = in_place
    for tier in tiers.values():
      tier.close()
    shutil.rmtree(root, ignore_errors=True)
  gb = (args.mib << 20) / 1e9
  for way in WAYS:
    median = statistics.median(seconds[way])
    print(f"{way}: write {median:.3f} s median ({gb / median:.2f} GB/s), arrays' buffers held "
          f"{statistics.median(held[way]):.3f} s ({', '.join(f'{s:.3f}' for s in seconds[way])})")
  ratio = statistics.median(seconds["in place"]) / statistics.median(seconds["buffer"])
  print(f"in place / buffer: {ratio:.2f}x the write's time")


if __name__ == "__main__":
  main()
