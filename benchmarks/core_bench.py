"""Local-tier save/restore bandwidth beside the machine's limits and plain Orbax, in one run.

  python benchmarks/core_bench.py --mib 512 --reps 5 [--json out.json]

One process, 4 CPU devices, a float32/bfloat16 state sharded over a 2x2 mesh. Every contender
moves the same bytes to/from the same RAM-disk folder; medians of `--reps` repetitions:

- raw write (new file): the host bytes written to a fresh file (the previous one deleted).
- raw write (overwrite): the same bytes written over the existing file's pages.
- raw read: the file read back into a new buffer, at the same point of each cycle as the
  orbax-mtc restore.
- orbax-mtc local save: save() until the step is committed (wait_until_finished); from the
  second save on, the tier reuses the retired step's file (overwrite case).
- orbax-mtc restore: restore(step) from the RAM tier onto the same shardings.
- plain Orbax: ocp.CheckpointManager on the RAM disk, StandardSave/StandardRestore.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_mtc as mtc  # noqa: E402


def make_state(mib: int, mesh: Mesh, seed: int) -> dict:
  n = mib * 2**20 // 4 // 3  # two thirds float32, one third bfloat16 (by element count)
  cols = 1024
  rows = max(4, (n // cols) // 4 * 4)
  key = jax.random.PRNGKey(seed)
  sh = NamedSharding(mesh, P("data", "model"))
  return {
      "w": jax.device_put(jax.random.normal(key, (rows, cols), jnp.float32), sh),
      "m": jax.device_put(jax.random.normal(key, (rows, cols), jnp.float32) * 0.5, sh),
      "h": jax.device_put(jax.random.normal(key, (rows, cols), jnp.bfloat16), sh),
      "step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P())),
  }


def host_bytes(state: dict) -> np.ndarray:
  parts = []
  for leaf in jax.tree.leaves(state):
    seen = set()
    for shard in leaf.addressable_shards:
      key = str(shard.index)
      if key not in seen:
        seen.add(key)
        parts.append(np.asarray(shard.data).reshape(-1).view(np.uint8))
  return np.concatenate(parts)


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def raw_write(path: str, data: np.ndarray, overwrite: bool) -> None:
  if not overwrite and os.path.exists(path):
    os.unlink(path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    view = memoryview(data)
    done = 0
    while done < data.nbytes:
      done += os.pwrite(fd, view[done:done + (64 << 20)], done)
    os.fsync(fd)
  finally:
    os.close(fd)


def raw_read(path: str) -> np.ndarray:
  out = np.empty(os.path.getsize(path), np.uint8)
  with open(path, "rb", buffering=0) as f:
    f.readinto(memoryview(out))
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--mib", type=int, default=512)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--root", default="/dev/shm/orbax-mtc-bench")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  root = args.root
  shutil.rmtree(root, ignore_errors=True)
  os.makedirs(root)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
  states = [make_state(args.mib, mesh, seed) for seed in range(2)]
  jax.block_until_ready(states)
  data = host_bytes(states[0])
  nbytes = data.nbytes
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          states[0])
  times: dict[str, list[float]] = {k: [] for k in (
      "memcpy", "raw_write_new", "raw_write_overwrite", "raw_read", "mtc_save", "mtc_blocking",
      "mtc_restore", "orbax_save", "orbax_restore")}
  try:
    raw = os.path.join(root, "raw.bin")
    scratch = np.empty_like(data)
    for _ in range(args.reps):
      times["memcpy"].append(timed(lambda: np.copyto(scratch, data)))
      times["raw_write_new"].append(timed(lambda: raw_write(raw, data, overwrite=False)))
      times["raw_write_overwrite"].append(timed(lambda: raw_write(raw, data, overwrite=True)))

    options = mtc.CheckpointManagerOptions(
        local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9),
        replication=mtc.ReplicationOptions(replica_axis="data"))
    with mtc.CheckpointManager(os.path.join(root, "mtc-local"), os.path.join(root, "mtc-p"),
                               mesh, abstract, options=options) as mgr:
      for rep in range(args.reps + 1):
        step = rep + 1
        state = states[rep % 2]
        started = time.perf_counter()
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        blocking = time.perf_counter() - started
        mgr.wait_until_finished()
        total = time.perf_counter() - started
        if rep:  # the first save allocates the staging buffer and the first file
          times["mtc_save"].append(total)
          times["mtc_blocking"].append(blocking)
          # Read the raw file at the same point of the cycle, in alternating order, so both
          # reads meet the same memory conditions (on this VM, touching memory that was just
          # handed back to the host costs far more than the read itself).
          def ours(s=step):
            times["mtc_restore"].append(timed(
                lambda: jax.block_until_ready(mgr.restore(s).state)))

          def limit():
            times["raw_read"].append(timed(lambda: raw_read(raw)))

          for run in ((limit, ours) if rep % 2 else (ours, limit)):
            run()
          assert mgr.last_restore.tier == "local"
    os.unlink(raw)

    with ocp.CheckpointManager(os.path.join(root, "orbax"),
                               options=ocp.CheckpointManagerOptions(max_to_keep=1)) as plain:
      for rep in range(args.reps + 1):
        step = rep + 1
        state = states[rep % 2]
        t = timed(lambda s=step, st=state: (plain.save(s, args=ocp.args.StandardSave(st)),
                                            plain.wait_until_finished()))
        if rep:
          times["orbax_save"].append(t)
          t = timed(lambda s=step: jax.block_until_ready(
              plain.restore(s, args=ocp.args.StandardRestore(abstract))))
          times["orbax_restore"].append(t)
  finally:
    shutil.rmtree(root, ignore_errors=True)

  med = {k: statistics.median(v) for k, v in times.items()}
  gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
  rows = [
      ("orbax-mtc local save", "mtc_save", "raw_write_new", "raw_write_overwrite", "orbax_save"),
      ("orbax-mtc restore (RAM)", "mtc_restore", "raw_read", None, "orbax_restore"),
  ]
  print(f"state: {nbytes / 2**20:.0f} MiB in one process (4 CPU devices), {args.reps} reps, "
        "medians")
  print("| what | GB/s | vs raw (new file) | vs raw (overwrite) / read | vs plain Orbax |")
  print("|---|---|---|---|---|")
  for label, ours, base, base2, orbax in rows:
    second = f"{gbps[ours] / gbps[base2]:.2f}x" if base2 else "-"
    print(f"| {label} | {gbps[ours]:.2f} | {gbps[ours] / gbps[base]:.2f}x | {second} | "
          f"{gbps[ours] / gbps[orbax]:.2f}x |")
  print(f"| save blocking vs memcpy | {med['mtc_blocking'] * 1e3:.1f} ms | "
        f"{med['mtc_blocking'] / med['memcpy']:.2f}x memcpy ({med['memcpy'] * 1e3:.1f} ms) | | |")
  print("limits GB/s: " + ", ".join(f"{k}={gbps[k]:.2f}" for k in
                                    ("memcpy", "raw_write_new", "raw_write_overwrite", "raw_read")))
  print(f"plain Orbax GB/s: save={gbps['orbax_save']:.2f} restore={gbps['orbax_restore']:.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"bytes": nbytes, "reps": args.reps, "seconds": times, "median_s": med,
                 "gbps": gbps, "jax": jax.__version__, "orbax": ocp.__version__}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
