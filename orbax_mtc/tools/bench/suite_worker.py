"""One process of `orbax-mtc bench suite`: every contender, every size, one job.

Run under the launcher (`orbax-mtc launch`, one CPU device per process). For each state size
(MiB held by each process) and repetition, every process measures, in this order and on the
same state, in its own RAM-disk folder: the limits (memcpy, raw write and read, ring
`ppermute` and `broadcast_one_to_all` of the same bytes), plain `ocp.CheckpointManager`,
Orbax's `experimental.emergency.CheckpointManager` (2 or more processes, two replicas), Orbax's
P2P manager (`experimental.emergency.p2p.CheckpointManager`: its save, its restore from the
process's own folder and, with two replicas, the restore of a node whose folder is wiped, which
fetches its files from a peer over the P2P manager's own sockets; `suite` runs it in a job of
its own) and orbax-mtc (save blocking, local save, restore, replication, recovery of a node whose RAM folder
is wiped, training-loop overhead). Each figure is the slowest process's. Process 0 prints one
`@@suite <json>` line per size.

With `--fresh-state on` (the default off CPU) every save, and every device-to-host limit, starts
from a fresh device copy of the state: JAX keeps an array's host copy once it was fetched, so
saving the same arrays again would skip the device-to-host copy a training step's new arrays
need. The blocking limit is then that copy (all shards at once), not a host memcpy.

With 2 or more processes (an even count) the mesh is (data=2, model=N/2): two data-parallel
replicas, each process holding `mib` MiB of the state, its twin in the other replica holding the
same shards. With one process the mesh is 1x1 and the multi-process contenders are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from orbax_mtc.tools.bench import suite_p2p
from orbax_mtc.tools.bench.suite_job import Job


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("--sizes", type=int, nargs="+", required=True, help="MiB per process")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--persistent", required=True, help="shared folder for Orbax/persistent")
  parser.add_argument("--shared-local", required=True,
                      help="shared RAM-disk folder for plain Orbax (one checkpoint for all)")
  parser.add_argument("--loop-steps", type=int, default=30)
  parser.add_argument("--loop-reps", type=int, default=1)
  parser.add_argument("--save-every", type=int, default=10)
  parser.add_argument("--step-ms", type=float, default=200.0)
  parser.add_argument("--fresh-state", choices=("auto", "on", "off"), default="auto",
                      help="save a fresh device copy of the state each time (auto: off on CPU)")
  parser.add_argument("--contenders", nargs="+",
                      default=["limits", "orbax", "emergency", "p2p", "mtc", "loop"])
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  from absl import flags

  flags.FLAGS(sys.argv[:1])  # Orbax's emergency manager reads absl flags
  import jax

  from orbax_mtc import arrays, distributed
  from orbax_mtc.tools.bench import limits

  args = _parse(argv)
  distributed.initialize()
  job = Job(args)
  for mib in args.sizes:
    res: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    state = job.make_state(mib, 1)
    jax.block_until_ready(state)
    abstract = arrays.abstract_tree(state)
    nbytes = job.state_bytes = limits.local_nbytes(state)
    rss_after, rss_peak = {"state": _rss_bytes()}, {}
    _peak_rss_bytes()

    def phase_done(name: str, after: dict = rss_after, peak: dict = rss_peak) -> None:
      after[name], peak[name] = _rss_bytes(), _peak_rss_bytes()

    if "limits" in args.contenders:
      _limits(job, state, res)
      phase_done("limits")
    if "orbax" in args.contenders:
      _plain_orbax(job, mib, state, abstract, res)
      phase_done("orbax")
    if "emergency" in args.contenders:
      if job.replicas < 2:
        notes["emergency"] = ("not run: Orbax's emergency.CheckpointManager needs two "
                              "data-parallel replicas (2 or more processes here)")
      else:
        _emergency(job, mib, state, abstract, res)
        behind = job.realign_orbax_operations()
        if behind:
          print(f"suite_worker: process {job.me} was {behind} Orbax operations behind after "
                "Orbax's emergency manager; realigned", file=sys.stderr, flush=True)
        notes["emergency"] = ("replica 0 saves only to persistent storage, replica 1 to its "
                              "RAM folders (Orbax's design); figures are the slowest process")
        phase_done("emergency")
    if "p2p" in args.contenders:
      suite_p2p.measure(job, mib, state, abstract, res)
      behind = job.realign_orbax_operations()
      if behind:
        print(f"suite_worker: process {job.me} was {behind} Orbax operations behind after "
              "Orbax's P2P manager; realigned", file=sys.stderr, flush=True)
      notes["p2p"] = ("every process saves its own shards to its RAM folder (Orbax's OCDBT "
                      "format); nothing is copied to peers at save time: a node without the "
                      "step fetches a data-parallel twin's files when it restores, so with one "
                      "replica a lost node falls back to persistent storage")
      phase_done("p2p")
    if "mtc" in args.contenders:
      _mtc_local(job, mib, state, abstract, res)
      phase_done("mtc")
      if job.n > 1:
        _replication_and_recovery(job, mib, state, abstract, res)
        phase_done("peers")
    if "loop" in args.contenders:
      _loop_overhead(job, mib, state, abstract, res)
      phase_done("loop")
    del state
    if job.me == 0:
      print("@@suite " + json.dumps({
          "procs": job.n, "mib": mib, "bytes_per_process": nbytes, "replicas": job.replicas,
          "backend": job.backend, "device_kind": jax.devices()[0].device_kind,
          "fresh_state": job.fresh_state,
          "seconds": res, "notes": notes,
          "rss_bytes_after": rss_after, "peak_rss_bytes": rss_peak}), flush=True)
  return 0


def _release_memory() -> None:
  """Hands freed heap memory back to the system between contenders: glibc keeps the arenas
  that Orbax's and TensorStore's threads used, which would otherwise add up to several copies
  of the state by the last contender (and make later contenders reuse warm pages)."""
  import ctypes
  import gc

  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to trim
    pass


def _rss_bytes() -> int:
  """This process's resident memory now, after releasing what is free."""
  _release_memory()
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
  """The highest resident memory since the last call (the kernel's VmHWM, then reset)."""
  peak = 0
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
  try:
    with open("/proc/self/clear_refs", "w") as clear:
      clear.write("5")  # resets VmHWM to the current RSS
  except OSError:
    pass
  return peak


def _limits(job: Job, state: Any, res: dict) -> None:
  import numpy as np

  from orbax_mtc.tools.bench import limits

  data = limits.host_bytes(state)
  raw = str(job.local_root / "raw.bin")
  scratch = np.empty_like(data)
  limits.memcpy(scratch, data)  # into pages already mapped, as a reused buffer's
  for _ in range(job.args.reps):
    job.measure(res, "memcpy_s", lambda: limits.memcpy(scratch, data))
    job.measure(res, "raw_write_new_s", lambda: limits.raw_write(raw, data, overwrite=False))
    job.measure(res, "raw_write_overwrite_s",
                lambda: limits.raw_write(raw, data, overwrite=True))
    job.measure(res, "raw_read_s", lambda: limits.raw_read(raw), warm=True)
    if job.fresh_state:
      job.measure_device_to_host(res, "d2h_s", state)
  os.unlink(raw)
  if job.n > 1:
    permute = limits.RingPermute(data.nbytes)
    for _ in range(job.args.reps):
      job.measure(res, "raw_ppermute_s", permute)
    del permute
    for _ in range(job.args.reps):
      job.measure(res, "raw_broadcast_s", lambda: limits.broadcast(data))


def _plain_orbax(job: Job, mib: int, state: Any, abstract: Any, res: dict) -> None:
  import jax
  import orbax.checkpoint as ocp

  folder = Path(job.args.shared_local) / f"orbax-{mib}"
  with ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
      max_to_keep=1)) as plain:
    for rep in range(job.args.reps + 1):
      step = rep + 1
      current = job.fresh(state)
      job.barrier()
      start = time.perf_counter()
      plain.save(step, args=ocp.args.StandardSave(current))
      blocking = time.perf_counter() - start
      plain.wait_until_finished()
      total = time.perf_counter() - start
      if rep == 0:  # first save: directory creation, compilation of the copy
        continue
      job.record(res, "orbax_blocking_s", blocking)
      job.record(res, "orbax_save_s", total)
      restored = job.measure(res, "orbax_restore_s", lambda s=step: jax.block_until_ready(
          plain.restore(s, args=ocp.args.StandardRestore(abstract))), warm=True)
      del restored
  job.barrier()
  if job.me == 0:
    shutil.rmtree(folder, ignore_errors=True)


def _mtc_local(job: Job, mib: int, state: Any, abstract: Any, res: dict) -> None:
  """Local tier alone (peers off): blocking time, save until committed, restore.

  Each repetition also takes the limit each of these is held to right beside it (a memcpy
  before the save, a raw overwrite of the same bytes after it, a raw read before the
  restore), so that a target ratio compares figures taken moments apart: on a shared VM the
  machine's speed drifts between the phases of a run.
  """
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from orbax_mtc.tools.bench import limits

  folder = job.local_root / f"mtc-{mib}"
  data = limits.host_bytes(state)
  scratch = np.empty_like(data)
  limits.memcpy(scratch, data)  # into pages already mapped, as a reused buffer's
  raw = str(job.local_root / f"paired-{mib}.bin")
  limits.raw_write(raw, data, overwrite=False)  # as the reused step file: overwritten in place
  with job.mtc_manager(folder, abstract, peers=False) as mgr:
    for rep in range(job.args.reps + 1):
      step = rep + 1
      if rep > 0:
        job.measure(res, "paired_memcpy_s", lambda: limits.memcpy(scratch, data))
        if job.fresh_state:
          job.measure_device_to_host(res, "paired_d2h_s", state)
      current = job.fresh(state)
      job.barrier()
      start = time.perf_counter()
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(current)))
      blocking = time.perf_counter() - start
      mgr.wait_until_finished()
      total = time.perf_counter() - start
      if rep == 0:  # the first save creates the tier's first step file
        continue
      job.record(res, "mtc_blocking_s", blocking)
      job.record(res, "mtc_save_s", total)
      job.measure(res, "paired_raw_write_s", lambda: limits.raw_write(raw, data, overwrite=True))
      job.measure(res, "paired_raw_read_s", lambda: limits.raw_read(raw), warm=True)
      restored = job.measure(res, "mtc_restore_s", lambda s=step: jax.block_until_ready(
          mgr.restore(s).state), warm=True)
      assert mgr.last_restore.tier == "local", mgr.last_restore
      if rep == 1 and not job.equal(restored, state):
        raise AssertionError("orbax-mtc restore is not bit-exact")
      del restored
  data = scratch = None  # freed before the next phase
  os.unlink(raw)
  job.barrier()
  shutil.rmtree(folder, ignore_errors=True)


def _emergency(job: Job, mib: int, state: Any, abstract: Any, res: dict) -> None:
  """Orbax's experimental.emergency.CheckpointManager, set up the way MaxText sets it up."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

  folder = job.local_root / f"emergency-{mib}"
  folder.mkdir(parents=True, exist_ok=True)  # it must exist before the manager is built
  options = emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
      persistent=emergency.PersistentCheckpointOptions(save_interval_steps=10**9,
                                                       max_to_keep=1))
  persistent = Path(job.args.persistent) / f"emergency-{mib}"
  with emergency.CheckpointManager(folder, persistent, job.mesh, abstract,
                                   options=options) as manager:
    job.save_restore_reps(
        res, "emergency", state,
        lambda s, current: manager.save(
            s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(current))),
        manager.wait_until_finished, lambda s: manager.restore(s).state,
        "Orbax emergency")
  job.barrier()
  shutil.rmtree(folder, ignore_errors=True)


def _replication_and_recovery(job: Job, mib: int, state: Any, abstract: Any,
                              res: dict) -> None:
  """Peers on, in two layouts: `twin` (two replicas: the twin already holds the same shards,
  so only the manifest moves and a replaced node reads its twin's bytes) and `ring` (one
  replica: every byte of a node's step goes to the next node). For each: replicate_pending()
  after a committed save, then a restore from every node's own folder and one after the last
  node lost its RAM folder (fresh managers for both)."""
  from orbax_mtc import arrays

  layouts = [("twin", state, abstract, job.mesh)] if job.replicas > 1 else []
  ring_mesh = job.layout(1)
  ring_state = job.make_state(mib, 3, ring_mesh)
  ring_abstract = arrays.abstract_tree(ring_state)
  layouts.append(("ring", ring_state, ring_abstract, ring_mesh))
  for name, item, item_abstract, mesh in layouts:
    _replicate_and_recover(job, f"mtc-{name}-{mib}", name, item, item_abstract, mesh, res)


def _replicate_and_recover(job: Job, folder_name: str, layout: str, state: Any,
                           abstract: Any, mesh, res: dict) -> None:
  import jax
  import orbax.checkpoint as ocp

  folder = job.local_root / folder_name
  for rep in range(job.args.reps):
    step = rep + 1
    with job.mtc_manager(folder, abstract, peers=True, mesh=mesh) as mgr:
      # Due in RAM only (a forced save would also start a persistent backup, whose threads
      # would run during the replication measured next).
      assert mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
          job.fresh(state))))
      mgr.wait_until_local_finished()  # committed in RAM; the peer copies are still to go
      job.measure(res, f"mtc_replication_{layout}_s", mgr.replicate_pending)
      res.setdefault(f"mtc_replication_{layout}_bytes", []).append(
          job.slowest(float(mgr.last_replication_bytes)))
    with job.mtc_manager(folder, abstract, peers=True, mesh=mesh) as mgr:
      job.measure(res, f"mtc_local_restore_{layout}_s", lambda m=mgr: jax.block_until_ready(
          m.restore(None).state), warm=True)
      assert mgr.last_restore.step == step and mgr.last_restore.tier == "local", \
          mgr.last_restore
    job.barrier()
    if job.me == job.n - 1:  # the replaced node: its RAM folder is gone
      shutil.rmtree(folder)
      folder.mkdir()
    with job.mtc_manager(folder, abstract, peers=True, mesh=mesh) as mgr:
      restored = job.measure(res, f"mtc_recovery_{layout}_s", lambda m=mgr: jax.block_until_ready(
          m.restore(None).state), warm=True)
      assert mgr.last_restore.step == step, mgr.last_restore
      if rep == 0 and not job.equal(restored, state):
        raise AssertionError(f"orbax-mtc recovery ({layout}) is not bit-exact")
      del restored
  job.barrier()
  shutil.rmtree(folder, ignore_errors=True)


def _loop_overhead(job: Job, mib: int, state: Any, abstract: Any, res: dict) -> None:
  """A training loop padded to --step-ms per step, without saves and with a local save every
  --save-every steps (peers off, then on); the padding stands for accelerator time, during
  which the host is free. Each manager saves twice before the timed loop (steady state)."""
  import jax
  import orbax.checkpoint as ocp

  args = job.args
  # The step's compute is device time, which the padding stands for; on CPU the "device" is
  # the host's own cores, so an update that rewrote the whole state would take the host time
  # an accelerator leaves free (and at 1 GiB outlast the step). Only the step counter changes;
  # the arrays are passed through, and every save still copies and writes all their bytes.
  # With --fresh-state (an accelerator) the arrays are copied on the device each step, so
  # that every save waits for their device-to-host copy, as after a real step.
  bump = jax.jit(lambda step: step + 1)

  def update(s: dict) -> dict:
    arrays = job.fresh({"w": s["w"], "h": s["h"]})
    return {**arrays, "step": bump(s["step"])}

  jax.block_until_ready(update(state))
  variants = [("loop_plain_s", None), ("loop_local_s", False)]
  if job.n > 1:
    variants.append(("loop_peers_s", True))
  folder = job.local_root / f"loop-{mib}"
  for _ in range(args.loop_reps):
    for name, peers in variants:
      current = state
      mgr = None if peers is None else job.mtc_manager(folder, abstract, peers=peers,
                                                        every=args.save_every)
      if mgr is not None:
        # Steady state: a long run pays the first saves' one-time costs once, not every
        # `--loop-steps`: the tier's max_to_keep + 1 step files (later saves overwrite the file
        # of the step retention retired; a new file costs fresh RAM-disk pages, seconds per GiB
        # on this VM). Steps 1 and 2 (step 0 would be due in the persistent tier too).
        for warm_step in (1, 2):
          mgr.save(warm_step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(current)),
                   force=True)
          mgr.wait_until_finished()
      job.barrier()
      start = time.perf_counter()
      for step in range(3, args.loop_steps + 3):
        began = time.perf_counter()
        current = update(current)
        jax.block_until_ready(current)
        pad = args.step_ms / 1000 - (time.perf_counter() - began)
        if pad > 0:
          time.sleep(pad)  # stands for device time, not for synchronisation
        if mgr is not None:
          mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(current)))
      # The last save's write would overlap the steps after it in a long run; a write slower
      # than the save interval shows up in the next save() (it waits), which is timed.
      job.record(res, name, time.perf_counter() - start)
      if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()
      del current
      job.barrier()
      shutil.rmtree(folder, ignore_errors=True)
      if job.me == 0:
        shutil.rmtree(Path(args.persistent) / folder.name, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
