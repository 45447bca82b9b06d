"""The save's device-to-host path on one accelerator: is it correct, and how fast is each leg.

  python benchmarks/gpu_staging.py --mib 1024 4096 --reps 3 --out DIR

1. check: a training loop that donates its state right after each `save()` (every step, the
   state in device memory, int32 so a numpy replay gives the exact expected bytes) saves 6
   steps; each is restored from the RAM tier and compared bit for bit. Exit 1 on a mismatch.
2. bandwidth, per size, medians of `--reps` (GB/s, 1e9 bytes): device-to-host into fresh
   pageable numpy memory (`np.asarray`), into pinned host memory (`jax.device_put` to the
   device's `pinned_host` memory, what a save now starts), pinned to fresh numpy pages (the
   copy the writer avoids by reading the pinned buffer in place), a host memcpy into reused
   pages, and a raw RAM-disk overwrite of the state from one thread into one file, from 4
   threads into 4 files, and from 4 threads into one file mapped in memory (tmpfs serialises
   `pwrite`s to one file; a mapped file takes parallel copies).

Writes gpu-staging.json and gpu-staging.md under `--out`; runs on CPU too (the pinned path
is then forced, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import orbax_mtc as mtc
from orbax_mtc import arrays
from orbax_mtc.local import staging


def _update(state: dict) -> dict:
  return {"w": state["w"] * 3 + 1, "b": state["b"] + 7}


def check(root: Path, mib: int) -> bool:
  """Saves 6 steps, each followed at once by a step that donates the state; restores each."""
  device = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
  n = max(1, mib * 2**20 // 4)
  host = {"w": np.arange(n, dtype=np.int32), "b": np.arange(8, dtype=np.int32)}
  state = {k: jax.device_put(v, device) for k, v in host.items()}
  step_fn = jax.jit(_update, donate_argnums=0)
  abstract = arrays.abstract_tree(state)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=6),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9))
  expected = {}
  ok = True
  with mtc.CheckpointManager(root / "local", root / "persistent", mesh, abstract,
                             options=options) as mgr:
    for step in range(1, 7):
      state = step_fn(state)
      host = _update(host)  # numpy replay: int32 wraps as XLA's does
      expected[step] = host
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=True)
    mgr.wait_until_finished()
    for step, want in expected.items():
      got = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract))).state
      same = all(np.array_equal(np.asarray(got[k]), v) for k, v in want.items())
      print(f"check: step {step} restored from {mgr.last_restore.tier}: "
            f"{'bit-exact' if same else 'MISMATCH'}", flush=True)
      ok &= same
  return ok


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
  return nbytes / statistics.median(seconds) / 1e9


def _write_files(views: list[memoryview], paths: list[Path]) -> None:
  def one(view: memoryview, path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
      for at in range(0, view.nbytes, 64 << 20):
        os.pwrite(fd, view[at:at + (64 << 20)], at)
    finally:
      os.close(fd)
  threads = [threading.Thread(target=one, args=vp) for vp in zip(views, paths, strict=True)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()


def _write_mapped(source: np.ndarray, path: Path, threads: int) -> None:
  """Copies `source` into the file at `path` through a shared mapping, from `threads` threads
  (space reserved first: a mapped write past the RAM disk's end would be a SIGBUS)."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    os.posix_fallocate(fd, 0, source.nbytes)
    with mmap.mmap(fd, source.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as mapped:
      target = np.frombuffer(mapped, np.uint8)
      part = -(-source.nbytes // threads)

      def one(i: int, into: np.ndarray) -> None:
        for at in range(i * part, min((i + 1) * part, source.nbytes), 64 << 20):
          end = min(at + (64 << 20), (i + 1) * part, source.nbytes)
          np.copyto(into[at:end], source[at:end])
      workers = [threading.Thread(target=one, args=(i, target)) for i in range(threads)]
      for t in workers:
        t.start()
      for t in workers:
        t.join()
      del target, workers  # no view may outlive the mapping
  finally:
    os.close(fd)


def bandwidth(root: Path, mib: int, reps: int) -> dict:
  device = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  nbytes = mib * 2**20
  x = jax.device_put(jnp.arange(nbytes // 4, dtype=jnp.int32), device)
  fresh = jax.jit(lambda a: a + 1)
  times: dict[str, list[float]] = {k: [] for k in (
      "d2h_pageable", "d2h_pinned", "pinned_to_numpy", "memcpy", "write_1", "write_4",
      "write_mapped_4")}
  reused = np.empty(nbytes, np.uint8)
  for _ in range(reps + 1):  # the first round warms up allocators and files
    y = fresh(x).block_until_ready()
    t = time.perf_counter()
    pageable = np.asarray(y)
    times["d2h_pageable"].append(time.perf_counter() - t)
    y = fresh(x).block_until_ready()
    t = time.perf_counter()
    p = jax.device_put(y, pinned).block_until_ready()
    times["d2h_pinned"].append(time.perf_counter() - t)
    t = time.perf_counter()
    copied = np.asarray(p)
    times["pinned_to_numpy"].append(time.perf_counter() - t)
    view = staging._pinned_view(p, nbytes)
    if view is None or not np.array_equal(view.view(np.int32), pageable):
      raise AssertionError("the pinned buffer read in place is not the array's bytes")
    t = time.perf_counter()
    np.copyto(reused, view)
    times["memcpy"].append(time.perf_counter() - t)
    t = time.perf_counter()
    _write_files([memoryview(view)], [root / "raw-1"])
    times["write_1"].append(time.perf_counter() - t)
    quarter = nbytes // 4
    t = time.perf_counter()
    _write_files([memoryview(view[i * quarter:(i + 1) * quarter]) for i in range(4)],
                 [root / f"raw-4-{i}" for i in range(4)])
    times["write_4"].append(time.perf_counter() - t)
    t = time.perf_counter()
    _write_mapped(view, root / "raw-mapped", 4)
    times["write_mapped_4"].append(time.perf_counter() - t)
    del pageable, copied, view, p, y
  for name in times:
    times[name] = times[name][1:]
  return {"mib": mib, **{f"{k}_gbps": _median_gbps(nbytes, v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--check-mib", type=int, default=256)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if jax.default_backend() == "cpu":  # a smoke test of the GPU path
    staging.COPY_ON_CPU = staging.PIN_ON_CPU = True
  base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
  root = Path(tempfile.mkdtemp(prefix="orbax-mtc-gpu-staging-", dir=base))
  try:
    ok = check(root / "check", args.check_mib)
    rows = [bandwidth(root, mib, args.reps) for mib in args.mib]
  finally:
    for path in sorted(root.rglob("*"), reverse=True):
      path.rmdir() if path.is_dir() else path.unlink()
    root.rmdir()
  device = jax.devices()[0]
  lines = [f"Device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
           f"GB/s (1e9 bytes/s), median of {args.reps}; save-then-donate check: "
           f"{'bit-exact' if ok else 'MISMATCH'}.", "",
           "| MiB | d2h pageable | d2h pinned | pinned / pageable | pinned -> numpy | memcpy | "
           "RAM-disk write 1 thread | 4 threads, 4 files | 4 threads, 1 mapped file |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['mib']} | {r['d2h_pageable_gbps']:.2f} | {r['d2h_pinned_gbps']:.2f} | "
                 f"{r['d2h_pinned_gbps'] / r['d2h_pageable_gbps']:.1f}x | "
                 f"{r['pinned_to_numpy_gbps']:.2f} | {r['memcpy_gbps']:.2f} | "
                 f"{r['write_1_gbps']:.2f} | {r['write_4_gbps']:.2f} | "
                 f"{r['write_mapped_4_gbps']:.2f} |")
  print("\n".join(lines))
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-staging.md").write_text("\n".join(lines) + "\n")
    (out / "gpu-staging.json").write_text(json.dumps(
        {"device": device.device_kind, "backend": jax.default_backend(), "check_ok": ok,
         "args": vars(args), "rows": rows}, indent=1))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
