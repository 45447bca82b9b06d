"""Peer replication and recovery, measured against baselines taken in the same run.

  python benchmarks/peer_bench.py --mib 256 --procs 2 [--json out.json]

`--procs` real JAX processes (1 CPU device each) joined by jax.distributed on localhost, each
holding `--mib` MiB of a state sharded over every process (one replica: every byte of a node's
checkpoint must travel to its peer). Reported, medians of `--reps`:

- raw ppermute: one jitted shard_map ppermute of a plain uint8 array of the same size as a
  node's replication stream (ring), compiled beforehand.
- replication: `replicate_pending()` right after a committed local save (blocking, chunked).
- extra blocking per save: time spent inside `save()` calls of a loop that trains (a
  reduction over the state, repeated to last about `--train-ms`) and saves every 4 steps, with
  peers minus without peers, beside the staging copy (device -> host) of one save.
- recovery: restore(None) after the last node lost its whole RAM folder (its step comes from
  its peer's copy), vs a restore of the same step from every node's own folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _worker(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1), ("data", "model"))
  cols = 1024
  rows = args.mib * 2**20 // 4 // cols * n
  sharding = NamedSharding(mesh, P("model"))

  def make_state(step: int) -> dict:
    w = jax.jit(lambda: jnp.full((rows, cols), step, jnp.float32) +
                jnp.arange(cols, dtype=jnp.float32), out_shardings=sharding)()
    return {"w": w, "step": np.int32(step)}

  train = jax.jit(lambda s: jnp.sum(s["w"]))
  local_root = Path(distributed.local_directory())
  results: dict[str, list[float]] = {}

  def barrier(name):
    multihost_utils.sync_global_devices(name)

  def slowest(seconds: float) -> float:
    return float(np.max(multihost_utils.process_allgather(np.asarray([seconds]))))

  def manager(name: str, peers: int | None) -> mtc.CheckpointManager:
    options = mtc.CheckpointManagerOptions(
        local=mtc.LocalCheckpointOptions(save_interval_steps=4, max_to_keep=1),
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6),
        replication=mtc.ReplicationOptions(replica_axis="data", peers_per_node=peers))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(
        x, "sharding", None)), make_state(0))
    return mtc.CheckpointManager(local_root / name, Path(args.persistent) / name, mesh,
                                 abstract, options=options)

  # 1. raw ppermute of a plain array, as big as one node's stream.
  stream_bytes = args.mib * 2**20 + 64 * 1024
  node_mesh = jax.sharding.Mesh(np.array([d for d in devices if d.id == min(
      x.id for x in devices if x.process_index == d.process_index)]), ("p",))
  perm = tuple((i, (i + 1) % n) for i in range(n))
  permute = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "p", perm), mesh=node_mesh,
                                  in_specs=P("p"), out_specs=P("p")))
  local = np.ones((stream_bytes,), np.uint8)
  x = jax.make_array_from_single_device_arrays(
      (stream_bytes * n,), NamedSharding(node_mesh, P("p")),
      [jax.device_put(local, node_mesh.devices[me])])
  permute(x).block_until_ready()
  for _ in range(args.reps):
    barrier("raw")
    t = time.perf_counter()
    permute(x).block_until_ready()
    results.setdefault("raw_ppermute_s", []).append(slowest(time.perf_counter() - t))

  # 2 + 3. save loops with and without peers; replication bandwidth. A "training step" is
  # a reduction over the state repeated to last about --train-ms.
  state0 = make_state(0)
  train(state0).block_until_ready()
  t = time.perf_counter()
  train(state0).block_until_ready()
  one = max(time.perf_counter() - t, 1e-4)
  train_reps = int(multihost_utils.process_allgather(
      np.asarray([max(1, round(args.train_ms / 1000 / one))])).max())
  results["train_step_s"] = [slowest(one * train_reps)]
  for peers, name in ((0, "no-peers"), (None, "with-peers")):
    with manager(name, peers) as mgr:
      inside = 0.0
      staging = []
      step = 0
      for step in range(args.steps):
        state = make_state(step)
        for _ in range(train_reps):
          train(state).block_until_ready()
        t = time.perf_counter()
        saved = mgr.save(step, args=ocp.args.PyTreeSave(state))
        inside += time.perf_counter() - t
        if saved and mgr.last_save_blocking_seconds is not None:
          staging.append(mgr.last_save_blocking_seconds)
      mgr.wait_until_finished()
      saves = len(staging)
      results.setdefault(f"save_calls_{name}_s_per_save", []).append(
          slowest(inside) / max(1, saves))
      results.setdefault("staging_s", []).append(slowest(statistics.median(staging)))
      if peers is None:
        for rep in range(args.reps):
          step += 4
          mgr.save(step, args=ocp.args.PyTreeSave(make_state(step)), force=True)
          mgr._wait_local()  # committed locally; the copies are still to go
          barrier(f"repl-{rep}")
          t = time.perf_counter()
          mgr.replicate_pending()
          results.setdefault("replication_s", []).append(slowest(time.perf_counter() - t))
          results.setdefault("replication_bytes", []).append(
              float(mgr._replicator.last_bytes_sent))
        last_step = step

  # 4. recovery of a replaced node vs a restore from own folders.
  for rep in range(args.reps):
    with manager("with-peers", None) as mgr:
      barrier(f"local-{rep}")
      t = time.perf_counter()
      mgr.restore(None)
      results.setdefault("local_restore_s", []).append(slowest(time.perf_counter() - t))
      assert mgr.last_restore.step == last_step, mgr.last_restore
    barrier(f"wipe-{rep}")
    if me == n - 1:  # the replaced node: its RAM disk is empty
      shutil.rmtree(local_root / "with-peers")
      (local_root / "with-peers").mkdir()
    barrier(f"wiped-{rep}")
    with manager("with-peers", None) as mgr:
      t = time.perf_counter()
      mgr.restore(None)
      seconds = slowest(time.perf_counter() - t)
      tiers = multihost_utils.process_allgather(
          np.asarray([1 if mgr.last_restore.tier == "peer" else 0]))
      assert int(np.sum(tiers)) == 1 and mgr.last_restore.step == last_step, mgr.last_restore
      results.setdefault("recovery_s", []).append(seconds)
  if me == 0:
    print("@@bench " + json.dumps(results), flush=True)


def _driver(args) -> int:
  from orbax_mtc import launch

  workdir = Path(tempfile.mkdtemp(prefix="orbax-mtc-peerbench-", dir="/dev/shm"))
  persistent = Path(tempfile.mkdtemp(prefix="orbax-mtc-peerbench-persistent-"))
  lines: list[str] = []

  class Collect:
    def write(self, text):
      lines.append(text)
      return len(text)

    def flush(self):
      pass

  try:
    result = launch.run_processes(
        [sys.executable, __file__, "--worker", "--mib", str(args.mib), "--train-ms",
         str(args.train_ms), "--reps",
         str(args.reps), "--steps", str(args.steps), "--persistent", str(persistent)],
        args.procs, devices_per_process=1, local_root=workdir, output=Collect(),
        timeout_s=args.timeout_s)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(persistent, ignore_errors=True)
  text = "".join(lines)
  marker = [line for line in text.splitlines() if "@@bench " in line]
  if result.returncode != 0 or not marker:
    print(text[-6000:], file=sys.stderr)
    return 1
  raw = json.loads(marker[-1].split("@@bench ", 1)[1])
  med = {k: statistics.median(v) for k, v in raw.items()}
  mib = med["replication_bytes"] / 2**20
  raw_bw = (args.mib * 2**20 + 64 * 1024) / 2**30 / med["raw_ppermute_s"]
  repl_bw = med["replication_bytes"] / 2**30 / med["replication_s"]
  extra = med["save_calls_with-peers_s_per_save"] - med["save_calls_no-peers_s_per_save"]
  summary = {
      "procs": args.procs, "mib_per_process": args.mib, "reps": args.reps,
      "train_step_s": round(med["train_step_s"], 3),
      "replicated_mib_per_node": round(mib, 1),
      "raw_ppermute_gib_s": round(raw_bw, 3),
      "replication_gib_s": round(repl_bw, 3),
      "replication_vs_raw_ppermute": round(repl_bw / raw_bw, 2),
      "save_call_s_without_peers": round(med["save_calls_no-peers_s_per_save"], 4),
      "save_call_s_with_peers": round(med["save_calls_with-peers_s_per_save"], 4),
      "extra_blocking_s_per_save": round(extra, 4),
      "staging_copy_s": round(med["staging_s"], 4),
      "extra_blocking_vs_staging": round(extra / med["staging_s"], 2),
      "local_restore_s": round(med["local_restore_s"], 3),
      "recovery_s": round(med["recovery_s"], 3),
      "recovery_vs_local_restore": round(med["recovery_s"] / med["local_restore_s"], 2),
      "samples": raw,
  }
  print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))
  if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=2))
  return 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mib", type=int, default=256, help="state MiB per process")
  parser.add_argument("--procs", type=int, default=2)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--steps", type=int, default=24, help="steps of the save loops")
  parser.add_argument("--train-ms", type=float, default=30, help="length of a training step")
  parser.add_argument("--json", default=None)
  parser.add_argument("--timeout-s", type=float, default=900)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--persistent", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _worker(args)
    return 0
  return _driver(args)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
