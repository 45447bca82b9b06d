"""Whether a computation dispatched after a peer-copy chunk waits for the peer.

Each process places a chunk and issues its `ppermute` (as a `save()` issues its share of a
step's copies), then dispatches a jitted update of `--mib` MiB of its own state (the next
training step), and times the update; the last process joins the `ppermute` `--late-ms`
after the others. In the same run, the update alone, and after a chunk every process joins at
once. Run it under the launcher (one CPU device per process):

  orbax-mtc launch --nprocs 2 --devices-per-process 1 -- \\
      python benchmarks/collective_order.py --late-ms 500

On JAX's CPU client, computations of one device run in the order they were dispatched: an
update issued behind a chunk whose peer is late waits for the peer, so processes that do not
meet every step (no all-reduce in their step) pay each other's lateness at each chunk. A
data-parallel step meets every step already (`orbax-mtc bench every-step --sync-step`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from orbax_mtc import distributed, transport
from orbax_mtc.local import read as local_read


def _ring(n: int) -> tuple[tuple[int, int], ...]:
  return tuple((i, (i + 1) % n) for i in range(n))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mib", type=int, default=256, help="state MiB per process (update)")
  parser.add_argument("--chunk-mib", type=int, default=16, help="chunk MiB")
  parser.add_argument("--late-ms", type=float, default=500.0,
                      help="how late the last process joins the chunk's ppermute")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--json", type=Path, default=None, help="write the figures here")
  args = parser.parse_args(argv)
  distributed.initialize()
  n, me = jax.process_count(), jax.process_index()
  if n < 2:
    raise SystemExit("run it under `orbax-mtc launch --nprocs 2` (or more)")
  # Each chunk's collective input, made as the replicator's reader thread makes it.
  make_input = transport.background_placer(me)
  if make_input is None:
    raise SystemExit("this measures JAX's CPU client: run it with CPU devices")

  def chunk() -> jax.Array:
    buffer = local_read.aligned_empty(chunk_bytes, align=4096)
    buffer[:] = 0
    return make_input(buffer)

  permute = transport._permute_fn(_ring(n))  # noqa: SLF001 - the replicator's collective
  update = jax.jit(lambda w: w * 1.0001 + 1.0, donate_argnums=0)
  state = jnp.ones((args.mib << 20) // 4, jnp.float32)
  chunk_bytes = args.chunk_mib << 20
  state = jax.block_until_ready(update(state))  # compiled, warm
  jax.block_until_ready(permute(chunk()))
  late = me == n - 1
  figures: dict[str, list[float]] = {"alone_s": [], "after_joined_chunk_s": [],
                                     "after_late_chunk_s": []}
  for rep in range(args.reps):
    began = time.perf_counter()
    state = jax.block_until_ready(update(state))
    figures["alone_s"].append(time.perf_counter() - began)
    for key, wait in (("after_joined_chunk_s", 0.0), ("after_late_chunk_s", args.late_ms)):
      multihost_utils.sync_global_devices(f"collective-order-{rep}-{key}")
      if late:
        time.sleep(wait / 1000)  # the last process reaches its save() later
      out = permute(chunk())
      began = time.perf_counter()
      state = jax.block_until_ready(update(state))
      figures[key].append(time.perf_counter() - began)
      jax.block_until_ready(out)
  slowest_punctual = {key: float(np.max(multihost_utils.process_allgather(
      np.asarray(statistics.median(values)) if not late else np.asarray(0.0))))
      for key, values in figures.items()}
  record = {"processes": n, "mib": args.mib, "chunk_mib": args.chunk_mib,
            "late_ms": args.late_ms, "reps": args.reps,
            "punctual_update_median_s": slowest_punctual}
  if me == 0:
    print(f"update of {args.mib} MiB on the processes that joined on time (median of "
          f"{args.reps}, slowest): alone {slowest_punctual['alone_s'] * 1000:.1f} ms; after a "
          f"{args.chunk_mib} MiB chunk every process joined at once "
          f"{slowest_punctual['after_joined_chunk_s'] * 1000:.1f} ms; after one whose last "
          f"process joined {args.late_ms:g} ms late "
          f"{slowest_punctual['after_late_chunk_s'] * 1000:.1f} ms")
    if args.json is not None:
      args.json.write_text(json.dumps(record, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
