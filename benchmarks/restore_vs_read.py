"""Restore from RAM against a raw read of the same bytes: one process, median of --reps.

  python benchmarks/restore_vs_read.py --mib 1280 --reps 6

Both start from warm memory (see docs/benchmarks.md); used for the before/after figures of the
read-while-checksumming change.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import orbax_mtc as mtc
from orbax_mtc.tools.bench import limits


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mib", type=int, default=1024)
  parser.add_argument("--reps", type=int, default=6)
  parser.add_argument("--scratch", default="/dev/shm")
  args = parser.parse_args()
  root = Path(tempfile.mkdtemp(prefix="orbax-mtc-restore-", dir=args.scratch))
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    rows = args.mib * 2**20 // 4 // 1024
    rng = np.random.default_rng(0)
    state = {"w": jax.device_put(rng.random((rows * 3 // 4, 1024), np.float32), sharding),
             "h": jax.device_put(rng.random((rows - rows * 3 // 4, 1024), np.float32), sharding)}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    options = mtc.CheckpointManagerOptions(
        local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9),
        replication=mtc.ReplicationOptions(replica_axis="data", peers_per_node=0))
    with mtc.CheckpointManager(root / "local", root / "persistent", mesh, abstract,
                               options=options) as manager:
      manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
      manager.wait_until_finished()
      data = limits.host_bytes(state)
      raw = str(root / "raw.bin")
      limits.raw_write(raw, data, overwrite=False)
      reads, restores = [], []
      for _ in range(args.reps):
        limits.warm_memory(data.nbytes)
        start = time.perf_counter()
        limits.raw_read(raw)
        reads.append(time.perf_counter() - start)
        limits.warm_memory(data.nbytes)
        start = time.perf_counter()
        jax.block_until_ready(manager.restore(1).state)
        restores.append(time.perf_counter() - start)
    read, restore = statistics.median(reads), statistics.median(restores)
    print(f"{data.nbytes / 2**20:.0f} MiB: raw read {read:.3f} s, restore {restore:.3f} s, "
          f"restore / raw read bandwidth {read / restore:.2f}x")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
