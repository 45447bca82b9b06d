"""CRC32C throughput of google-crc32c (the dependency) against crc32c (the LGPL package it
replaced), on one buffer, in the chunks the local tier uses (`checksum.CRC_CHUNK`):

  python benchmarks/crc_throughput.py --gib 1 --reps 11 --threads 2

Contenders: `google-crc32c` (google_crc32c.extend, which holds the GIL for numpy arrays),
`orbax-mtc` (checksum.crc_extend: the same C library through ctypes, GIL released) and
`crc32c`, a dev-only comparison that is not a dependency: timed only where it is installed.
The buffer is allocated and filled once; the contenders then take turns (the first rotates
each repetition). Prints medians in GiB/s and ratios to crc32c, for one thread and for
`--threads` threads each checksumming its own slice, and how late a Python thread that sleeps
1 ms at a time wakes while one thread checksums (both show which contenders hold the GIL).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import threading
import time
from collections.abc import Callable

import google_crc32c
import numpy as np

from orbax_mtc.local import checksum

try:
  import crc32c
except ImportError:  # dev-only baseline
  crc32c = None

Extend = Callable[[int, np.ndarray], int]


def _chunked(extend: Extend, data: np.ndarray) -> int:
  value = 0
  for start in range(0, data.nbytes, checksum.CRC_CHUNK):
    value = extend(value, data[start:start + checksum.CRC_CHUNK])
  return value


def _timed(extend: Extend, data: np.ndarray, pool: concurrent.futures.Executor | None,
           threads: int) -> tuple[float, list[int]]:
  """Seconds to checksum `data` in `threads` equal slices (one per thread), and the values."""
  slices = np.array_split(data, threads)
  start = time.perf_counter()
  if pool is None:
    values = [_chunked(extend, s) for s in slices]
  else:
    values = list(pool.map(lambda s: _chunked(extend, s), slices))
  return time.perf_counter() - start, values


def _wake_gaps(extend: Extend, data: np.ndarray) -> list[float]:
  """Seconds between the wake-ups of a thread sleeping 1 ms at a time, while `extend`
  checksums `data` in this thread."""
  gaps: list[float] = []
  done = threading.Event()

  def tick() -> None:
    last = time.perf_counter()
    while not done.is_set():
      time.sleep(0.001)
      now = time.perf_counter()
      gaps.append(now - last)
      last = now

  ticker = threading.Thread(target=tick)
  ticker.start()
  time.sleep(0.01)  # the ticker is running before the checksum starts
  _chunked(extend, data)
  done.set()
  ticker.join()
  return gaps


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gib", type=float, default=1.0)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--threads", type=int, default=2,
                      help="also time this many threads (1: single-threaded only)")
  args = parser.parse_args()
  nbytes = int(args.gib * 2**30)
  data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)  # touches every page
  libraries: dict[str, Extend] = {"google-crc32c": google_crc32c.extend,
                                  "orbax-mtc": checksum.crc_extend}
  if crc32c is None:
    print("crc32c is not installed: timing google-crc32c alone (pip install crc32c to compare)")
  else:
    libraries["crc32c"] = lambda value, chunk: crc32c.crc32c(chunk, value)
  print(f"google-crc32c implementation: {google_crc32c.implementation}; "
        f"{nbytes / 2**30:g} GiB in {checksum.CRC_CHUNK >> 20} MiB chunks, {args.reps} reps")
  for threads in sorted({1, args.threads}):
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
    seconds: dict[str, list[float]] = {name: [] for name in libraries}
    results: dict[str, list[int]] = {}
    names = list(libraries)
    for rep in range(args.reps):
      turn = rep % len(names)
      for name in names[turn:] + names[:turn]:
        took, results[name] = _timed(libraries[name], data, pool, threads)
        seconds[name].append(took)
    if pool is not None:
      pool.shutdown()
    if len({tuple(v) for v in results.values()}) != 1:
      raise SystemExit(f"the libraries disagree: {results}")
    rates = {name: nbytes / 2**30 / statistics.median(s) for name, s in seconds.items()}
    line = ", ".join(f"{name} {rate:.2f} GiB/s (median {statistics.median(seconds[name]):.3f} s,"
                     f" min {min(seconds[name]):.3f}, max {max(seconds[name]):.3f})"
                     for name, rate in rates.items())
    if "crc32c" in rates:
      line += "; " + ", ".join(f"{name} / crc32c {rate / rates['crc32c']:.2f}x"
                               for name, rate in rates.items() if name != "crc32c")
    print(f"{threads} thread{'s' if threads > 1 else ''}: {line}")
  gaps: dict[str, list[float]] = {name: [] for name in libraries}
  for rep in range(args.reps):
    turn = rep % len(names)
    for name in names[turn:] + names[:turn]:
      gaps[name] += _wake_gaps(libraries[name], data)
  print("1 ms sleeper's wake-up gaps during one checksum: " + ", ".join(
      f"{name} p99 {np.percentile(g, 99) * 1e3:.1f} ms, max {max(g) * 1e3:.1f} ms"
      for name, g in gaps.items()))


if __name__ == "__main__":
  main()
