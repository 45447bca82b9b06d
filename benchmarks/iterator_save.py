"""What a data iterator's position adds to a save: the blocking time of `save()` with and
without per-process items, in one run.

One process (2 CPU devices), a state of --mib MiB sharded over them, a RAM tier on /dev/shm
and a persistent tier that is never due. Saves alternate between the two forms, --reps each,
after --warmup of each (steady state: the RAM folders are reused):

  arrays only     Composite(state=PyTreeSave(state))
  with iterators  the same plus iter=grain.checkpoint.CheckpointSave(iterator) (a Grain
                  DataLoader advanced one batch per step) and pos=ProcessJsonSave({...})

Reported: median seconds `save()` blocked the loop, and the ratio. Run from the repository
root:

  python benchmarks/iterator_save.py --mib 64 --reps 30 --out benchmarks/results
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def _loader():
  import grain

  sampler = grain.samplers.IndexSampler(num_records=1 << 20, shuffle=True, num_epochs=1,
                                        seed=0, shard_options=grain.sharding.NoSharding())
  return grain.DataLoader(data_source=grain.sources.RangeDataSource(0, 1 << 20, 1),
                          sampler=sampler, operations=[grain.transforms.Batch(8)],
                          worker_count=0)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=64, help="state size (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=30, help="saves of each form (default: %(default)s)")
  parser.add_argument("--warmup", type=int, default=3, help="(default: %(default)s)")
  parser.add_argument("--out", default=None, help="folder for iterator-save.json/md")
  args = parser.parse_args()

  import grain
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import orbax_mtc as mtc
  from orbax_mtc import arrays

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("model",))
  cols = 1024
  rows = args.mib * 2**20 // 4 // cols
  state = {"w": jax.device_put(jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols),
                               NamedSharding(mesh, P("model")))}
  root = pathlib.Path(tempfile.mkdtemp(prefix="orbax-mtc-bench-iter-", dir="/dev/shm"))
  iterator = iter(_loader())
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9))
  times: dict[str, list[float]] = {"arrays": [], "iterators": []}
  try:
    with mtc.CheckpointManager(root / "local", root / "persistent", mesh,
                               arrays.abstract_tree(state), options=options) as mgr:
      step = 1  # step 0 goes to the persistent tier too (Orbax's initial save)
      for rep in range(args.warmup + args.reps):
        for form in ("arrays", "iterators"):
          next(iterator)
          items = {"state": ocp.args.PyTreeSave(state)}
          if form == "iterators":
            items["iter"] = grain.checkpoint.CheckpointSave(iterator)
            items["pos"] = mtc.ProcessJsonSave({"step": step, "epoch": 0})
          mgr.wait_until_finished()  # the previous write is not part of this save's time
          started = time.perf_counter()
          mgr.save(step, args=ocp.args.Composite(**items))
          seconds = time.perf_counter() - started
          if rep >= args.warmup:
            times[form].append(seconds)
          step += 1
  finally:
    shutil.rmtree(root, ignore_errors=True)
  arrays_s = statistics.median(times["arrays"])
  iter_s = statistics.median(times["iterators"])
  command = "python benchmarks/iterator_save.py " + " ".join(
      f"--{k} {v}" for k, v in (("mib", args.mib), ("reps", args.reps)))
  text = (f"`{command}` ({platform.machine()}, {os.cpu_count()} CPUs, 2 CPU devices)\n\n"
          "| save() blocking time, median | seconds |\n|---|---|\n"
          f"| arrays only ({args.mib} MiB) | {arrays_s:.4f} |\n"
          f"| arrays + Grain iterator + JSON item | {iter_s:.4f} |\n"
          f"| ratio | {iter_s / arrays_s:.3f} |\n")
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "iterator-save.md").write_text(text)
    (out / "iterator-save.json").write_text(json.dumps({
        "command": command, "times": times, "median_s": {"arrays": arrays_s,
                                                         "iterators": iter_s}}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
