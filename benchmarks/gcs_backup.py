"""Backups to a loopback GCS server (fake-gcs-server, as in the tests), one process.

Part 1, bandwidth (median of --reps): plain Orbax saving the state to the server until durable,
beside orbax-mtc backing up the same state: its upload phase (the parent's save of the arrays
read back from RAM, until durable) and end to end (RAM save, read-back, upload).

Part 2, training-step slowdown: the same jitted training loop run with local saves only, with
local saves plus backups, with no checkpointing and with plain Orbax async saves to the server;
the median time of the steps taken while a backup (or plain save) is in flight, over the median
step of the loop without it.

Usage: python benchmarks/gcs_backup.py [--mib 64] [--reps 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
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


def _bandwidth(mib: int, reps: int, state, mesh, bucket: str) -> dict[str, list[float]]:
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc.save.backup_scheduler import BackupScheduler

  phases: dict[str, list[float]] = {"plain": [], "upload": [], "end_to_end": []}
  started: list[float] = []
  start_backup = BackupScheduler.start

  def timed_start(self, *a, **k):  # when the parent's save of the backup begins
    started.append(time.perf_counter())
    return start_backup(self, *a, **k)

  BackupScheduler.start = timed_start
  try:
    for rep in range(reps):
      mgr = ocp.CheckpointManager(f"gs://{bucket}/plain{rep}")
      t = time.perf_counter()
      mgr.save(0, args=ocp.args.StandardSave(state))
      mgr.wait_until_finished()
      phases["plain"].append(time.perf_counter() - t)
      mgr.close()
      options = mtc.CheckpointManagerOptions(
          local=mtc.LocalCheckpointOptions(save_interval_steps=1),
          persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
      local = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
      try:
        with mtc.CheckpointManager(local, f"gs://{bucket}/mtc{rep}", mesh, None,
                                   options=options) as mgr:
          t = time.perf_counter()
          mgr.save(0, args=ocp.args.StandardSave(state), force=True)
          mgr.wait_until_finished()
          done = time.perf_counter()
        phases["end_to_end"].append(done - t)
        phases["upload"].append(done - started[-1])
      finally:
        shutil.rmtree(local, ignore_errors=True)
  finally:
    BackupScheduler.start = start_backup
  return phases


def _train_loop(mode: str, state, mesh, steps: int, bucket: str, tag: str) -> dict:
  """Per-step times of a jitted training loop; `busy[i]` says whether a backup (or plain
  async save) was in flight when step i ran."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  @jax.jit
  def train_step(params):
    w = params["w"]
    h = jnp.tanh(params["x"] @ params["m"])  # compute-bound part of a step
    return {"w": w * 0.999 + 0.001 * jnp.mean(h), "x": params["x"], "m": params["m"]}

  params = dict(state)
  key = jax.random.key(0)
  params["x"] = jax.random.normal(key, (512, 1024))
  params["m"] = jax.random.normal(key, (1024, 1024))
  params = jax.block_until_ready(train_step(params))  # compile outside the timing

  local = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
  mgr = None
  if mode in ("local", "backup"):
    every = 20 if mode == "backup" else 10**6
    mgr = mtc.CheckpointManager(
        local, f"gs://{bucket}/loop-{mode}-{tag}", mesh, None,
        options=mtc.CheckpointManagerOptions(
            local=mtc.LocalCheckpointOptions(save_interval_steps=5),
            persistent=mtc.PersistentCheckpointOptions(save_interval_steps=every)))
  elif mode == "plain":
    mgr = ocp.CheckpointManager(f"gs://{bucket}/loop-plain-{tag}",
                                options=ocp.CheckpointManagerOptions(save_interval_steps=20))

  def in_flight() -> bool:
    if mode == "backup":
      return mgr.last_backup is not None and mgr.last_backup.state == "uploading" \
          or mgr.pending_backup is not None  # its read-back from RAM is running
    if mode == "plain":
      return mgr.is_saving_in_progress()
    return False

  times, busy = [], []
  try:
    for step in range(1, steps + 1):
      if mgr is not None:
        mgr.save(step, args=ocp.args.StandardSave({"w": params["w"]}))
      flight = in_flight()
      t = time.perf_counter()
      params = jax.block_until_ready(train_step(params))
      times.append(time.perf_counter() - t)
      busy.append(flight)
      if mode == "backup" and mgr.last_backup is not None:
        mgr.check_for_errors()  # learns of the end without waiting for a save
    if mgr is not None:
      mgr.wait_until_finished()
      mgr.close()
  finally:
    shutil.rmtree(local, ignore_errors=True)
  return {"times": times, "busy": busy}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=int, default=64, help="state size")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--steps", type=int, default=60, help="training steps per loop run")
  parser.add_argument("--json", default=None, help="write the raw figures here")
  args = parser.parse_args()

  from gcs_server import BUCKET, GcsServer

  server = GcsServer(pathlib.Path(tempfile.mkdtemp()))
  server.start()
  os.environ.update(server.env())  # before gcsfs / TensorStore make their clients
  logging.getLogger("gcsfs").setLevel(logging.ERROR)
  import jax
  import numpy as np

  mesh = jax.make_mesh((1,), ("data",))
  state = {"w": jax.device_put(
      np.random.default_rng(0).standard_normal(args.mib << 18).astype(np.float32))}
  loops: dict[str, list[dict]] = {m: [] for m in ("none", "local", "backup", "plain")}
  try:
    phases = _bandwidth(args.mib, args.reps, state, mesh, BUCKET)
    for rep in range(args.reps):
      for mode in loops:  # in turns, so drift of the machine hits every mode alike
        loops[mode].append(_train_loop(mode, state, mesh, args.steps, BUCKET, str(rep)))
  finally:
    server.kill()
    shutil.rmtree(server.data_dir, ignore_errors=True)

  med = {k: statistics.median(v) for k, v in phases.items()}
  print(f"state {args.mib} MiB, median of {args.reps}:")
  print(f"  plain Orbax save until durable     {med['plain']:.2f}s "
        f"({args.mib / med['plain']:.0f} MiB/s)")
  print(f"  orbax-mtc backup upload phase      {med['upload']:.2f}s "
        f"({args.mib / med['upload']:.0f} MiB/s): {med['plain'] / med['upload']:.2f}x plain")
  print(f"  orbax-mtc RAM save to durable      {med['end_to_end']:.2f}s "
        f"({args.mib / med['end_to_end']:.0f} MiB/s): "
        f"{med['plain'] / med['end_to_end']:.2f}x plain")

  def steps_of(mode: str, busy: bool | None) -> list[float]:
    return [t for run in loops[mode] for t, b in zip(run["times"], run["busy"], strict=True)
            if busy is None or b == busy]

  base_local = statistics.median(steps_of("local", None))
  during_backup = steps_of("backup", True)
  base_none = statistics.median(steps_of("none", None))
  during_plain = steps_of("plain", True)
  print(f"training step (median): local saves only {base_local * 1e3:.1f} ms; while a backup "
        f"is in flight {statistics.median(during_backup) * 1e3:.1f} ms over "
        f"{len(during_backup)} steps: slowdown "
        f"{statistics.median(during_backup) / base_local - 1:+.1%}")
  print(f"training step (median): no checkpointing {base_none * 1e3:.1f} ms; while plain "
        f"Orbax saves to the server {statistics.median(during_plain) * 1e3:.1f} ms over "
        f"{len(during_plain)} steps: slowdown "
        f"{statistics.median(during_plain) / base_none - 1:+.1%}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"mib": args.mib, "reps": args.reps, "phases": phases, "loops": loops}, indent=1))


if __name__ == "__main__":
  main()
