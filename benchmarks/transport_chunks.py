"""Peer-transfer speed against chunk size: one stream per process to the next, moved by
`orbax_mtc.transport` in chunks of each size, beside one `ppermute` of the whole stream.

Run it under the launcher (one CPU device per process):

  orbax-mtc launch --nprocs 2 --devices-per-process 1 --local-root /dev/shm/tc -- \
      python benchmarks/transport_chunks.py --mib 64 --reps 5

Prints, per chunk size and window, the slowest process's seconds (median, min, max) and the
ratio to the whole-stream ppermute measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from orbax_mtc import distributed, transport
from orbax_mtc.tools.bench import limits


def _slowest(seconds: float) -> float:
  return float(multihost_utils.process_allgather(np.asarray([seconds])).max())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=64, help="stream MiB per process")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--chunks-mib", type=int, nargs="+", default=[64, 32, 16, 8, 4, 1])
  parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4])
  args = parser.parse_args()
  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  nbytes = (args.mib << 20) + 1024  # a step stream: the state plus a small header
  source = np.random.default_rng(me).integers(0, 256, nbytes, dtype=np.uint8)
  received = np.empty(nbytes, np.uint8)
  streams = [transport.Stream(i, (i + 1) % n, nbytes) for i in range(n)]

  def run(chunk_mib: int, window: int) -> float:
    multihost_utils.sync_global_devices("transport-chunks")
    started = time.perf_counter()
    transport.Transfer(
        streams, me=me,
        reader_for=lambda s: lambda off, out: np.copyto(out, source[off:off + out.nbytes]),
        sink_for=lambda s: lambda off, data: np.copyto(received[off:off + data.nbytes], data),
        chunk_limit=chunk_mib << 20, window=window).run()
    return _slowest(time.perf_counter() - started)

  whole = limits.RingPermute(nbytes)
  baseline = []
  for _ in range(args.reps):
    multihost_utils.sync_global_devices("transport-whole")
    started = time.perf_counter()
    whole()
    baseline.append(_slowest(time.perf_counter() - started))
  base = limits.spread(baseline)["median"]
  if me == 0:
    print(f"{n} processes, {args.mib} MiB + 1 KiB per process; seconds, slowest process")
    print(f"one ppermute of the whole stream: {base:.4f} (min {min(baseline):.4f})")
  for chunk_mib in args.chunks_mib:
    for window in args.windows:
      run(chunk_mib, window)  # compiles this chunk shape outside the timed runs
      got = limits.spread([run(chunk_mib, window) for _ in range(args.reps)])
      if me == 0:
        print(f"chunk {chunk_mib:3d} MiB window {window}: median {got['median']:.4f} "
              f"(min {got['min']:.4f}, max {got['max']:.4f}) = {got['median'] / base:.2f}x "
              "the whole-stream ppermute")


if __name__ == "__main__":
  main()
