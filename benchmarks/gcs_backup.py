"""Backup to a loopback GCS server (fake-gcs-server, as in the tests): orbax-mtc's save of a
step (RAM tier, read back, Orbax upload) until durable, beside plain Orbax saving the same state
to the same server. One process; median of 3. Usage: python benchmarks/gcs_backup.py [MiB]."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]


def main() -> None:
  from gcs_server import BUCKET, GcsServer

  server = GcsServer(pathlib.Path(tempfile.mkdtemp()))
  server.start()
  os.environ.update(server.env())  # before gcsfs / TensorStore make their clients
  logging.getLogger("gcsfs").setLevel(logging.ERROR)
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
  mesh = jax.make_mesh((1,), ("data",))
  state = {"w": jax.device_put(
      np.random.default_rng(0).standard_normal(mib << 18).astype(np.float32))}
  plain, ours = [], []
  try:
    for rep in range(3):
      mgr = ocp.CheckpointManager(f"gs://{BUCKET}/plain{rep}")
      t = time.perf_counter()
      mgr.save(0, args=ocp.args.StandardSave(state))
      mgr.wait_until_finished()
      plain.append(time.perf_counter() - t)
      mgr.close()
      options = mtc.CheckpointManagerOptions(
          local=mtc.LocalCheckpointOptions(save_interval_steps=1),
          persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
      local = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
      with mtc.CheckpointManager(local, f"gs://{BUCKET}/mtc{rep}", mesh, None,
                                 options=options) as mgr:
        t = time.perf_counter()
        mgr.save(0, args=ocp.args.StandardSave(state), force=True)
        mgr.wait_until_finished()
        ours.append(time.perf_counter() - t)
      shutil.rmtree(local, ignore_errors=True)
  finally:
    server.kill()
    shutil.rmtree(server.data_dir, ignore_errors=True)
  p, o = statistics.median(plain), statistics.median(ours)
  print(f"state {mib} MiB: plain Orbax {p:.2f}s ({mib / p:.0f} MiB/s); orbax-mtc RAM save + "
        f"backup from RAM {o:.2f}s ({mib / o:.0f} MiB/s); orbax-mtc / plain bandwidth "
        f"{p / o:.2f}x")


if __name__ == "__main__":
  main()
