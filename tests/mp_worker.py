"""Child program of the multi-process tests: one JAX process of a `jax.distributed` job.

Started by `orbax_mtc.launch.Job` (which sets ORBAX_MTC_*; `orbax_mtc.distributed.initialize()`
joins the job), or alone for `plain-restore`. Every state is a pure function of (seed, step,
mesh shape), so a process that restores step S recomputes what was saved at S and compares it
bit for bit, on its own shards only. Output is one machine-readable line per event::

  @@mtc SAVING step=6                  just before mgr.save(6)
  @@mtc SAVED step=6 saved=1
  @@mtc COMMITTED process=0 local=4,6 persistent=0,4
  @@mtc RESULT process=0 step=6 tier=local ok=1 leaves=6 detail=-
  @@mtc DONE
  @@mtc PREEMPTED process=0 step=7     (preempt) reached_preemption(7) was True
  @@mtc ONDEMAND-SAVED process=0 step=7 info_step=7 persistent=1 total=0.329

Sub-commands:
  save           save steps [--start, --steps) (optionally restore first and resume), then close.
  restore        restore(None) and compare; --expect-step/--expect-tier make a mismatch an error.
  chaos          restore (if anything) and compare, then save every step until killed.
  plain-restore  one process, no jax.distributed: read the persistent tier with a plain
                 `ocp.CheckpointManager` (numpy and single-device targets) and compare.
  preempt        restore (if anything) and compare, then train and save every --stride steps
                 until SIGTERM (sent by the test to any process) makes every process agree on
                 an on-demand step; then exit as the manager's options or flags say. Hooks
                 inject timing (a write or a restore that waits for the notice, an on-demand
                 write that waits for a go file); see `cmd_preempt`.

Exit codes: 0 ok, 3 wrong data / wrong step or tier, 4 bad usage, 5 no preemption within
--max-steps, 6 the on-demand save did not behave as asked (returned under
exit_after_ondemand_checkpoint, or a second sync point).

The helpers at the bottom (`LineCollector`, `parse_results`) are imported by the tests; this
module imports JAX lazily so that importing it from pytest is cheap.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import sys
import threading
import time
from typing import Any

EXIT_MISMATCH = 3
EXIT_USAGE = 4
EXIT_NO_PREEMPTION = 5
EXIT_BAD_ONDEMAND = 6

# Leaf name -> (dtype, PartitionSpec axes, shape as a function of (data, model, rows)).
# "data" spans processes (one row of the mesh per process), "model" spans a process's devices.
_LEAVES: dict[str, tuple[str, tuple, Any]] = {
    "params/w": ("float32", ("data", "model"), lambda d, m, r: (d * r, 64)),
    "params/b": ("bfloat16", ("model",), lambda d, m, r: (16 * m,)),
    "opt/mu": ("float32", (None, "model"), lambda d, m, r: (4 * d, 4 * m)),
    "idx": ("int32", ("data",), lambda d, m, r: (8 * d, 3)),
    "count": ("int32", (), lambda d, m, r: ()),
    "lr": ("float32", (), lambda d, m, r: ()),
}

# With --keys, typed PRNG key leaves too: leaf name -> (implementation, axes, key array shape).
_KEY_LEAVES: dict[str, tuple[str, tuple, Any]] = {
    "rngs/dropout": ("unsafe_rbg", ("data",), lambda d, m, r: (4 * d,)),
    "rngs/params": ("threefry2x32", (), lambda d, m, r: ()),
}


MARK = "@@mtc"


def _out(line: str) -> None:
  """One event line, written with one write(2): stdout and stderr share the launcher's pipe,
  and print() would write the text and its newline separately, letting a log line from a C++
  thread land between them. Lines carry MARK so that a parser finds them even after a partial
  log line."""
  data = f"{MARK} {line}\n".encode()
  while data:
    data = data[os.write(1, data):]


# ----------------------------------------------------------------------------- values


_HASH_CACHE: dict[tuple, Any] = {}


def _hash_bits(leaf: str, shape: tuple[int, ...], index: tuple[slice, ...], seed: int):
  """uint64 pseudo-random bits of the global positions `index` of a leaf (step-independent)."""
  import numpy as np

  key = (leaf, shape, tuple((s.start, s.stop) for s in index), seed)
  cached = _HASH_CACHE.get(key)
  if cached is not None:
    return cached
  bounds = [sl.indices(dim)[:2] for sl, dim in zip(index, shape, strict=True)]
  strides = [int(np.prod(shape[k + 1:])) for k in range(len(shape))]
  lin = np.zeros([b - a for a, b in bounds], dtype=np.uint64)
  for k, ((a, b), stride) in enumerate(zip(bounds, strides, strict=True)):
    axis = np.arange(a, b, dtype=np.uint64) * np.uint64(stride)
    lin = lin + axis.reshape([-1 if j == k else 1 for j in range(len(shape))])
  leaf_id = sum(ord(c) * 131 ** i for i, c in enumerate(leaf)) % (1 << 31)
  x = lin + np.uint64((seed * 1_000_003 + leaf_id) % (1 << 62))
  # splitmix64
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  _HASH_CACHE[key] = x
  return x


def leaf_values(leaf: str, shape: tuple[int, ...], index: tuple[slice, ...], seed: int,
                step: int):
  """The values of global positions `index` of `leaf` at `step` (numpy, exact dtype)."""
  import ml_dtypes
  import numpy as np

  dtype = _LEAVES[leaf][0]
  if leaf == "count":
    return np.asarray(step, dtype=np.int32)
  if leaf == "lr":
    return np.asarray(1.0 / (step + 3), dtype=np.float32)
  h = _hash_bits(leaf, shape, index, seed)
  if dtype == "float32":
    # 24 random bits in [-4, 4), shifted by the step: exact, and different at every step.
    base = (h >> np.uint64(40)).astype(np.float64) * 2.0 ** -21 - 4.0
    return (base + step).astype(np.float32)
  if dtype == "bfloat16":
    k = ((h >> np.uint64(56)).astype(np.int64) + step) % 256 - 128
    return (k / 16.0).astype(ml_dtypes.bfloat16)  # k/16 with |k| <= 128 is exact in bf16
  if dtype == "int32":
    return ((h >> np.uint64(33)).astype(np.int64) - (1 << 30) + 7 * step).astype(np.int32)
  raise AssertionError(dtype)


def global_state_numpy(seed: int, step: int, data: int, model: int, rows: int) -> dict:
  """The whole state at `step` as nested dicts of numpy arrays (what any topology restores)."""
  out: dict[str, Any] = {}
  for leaf, (_, _, shape_fn) in _LEAVES.items():
    shape = shape_fn(data, model, rows)
    value = leaf_values(leaf, shape, tuple(slice(0, d) for d in shape), seed, step)
    _set(out, leaf, value)
  return out


def _set(tree: dict, path: str, value: Any) -> None:
  *parents, last = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[last] = value


def _get(tree: Any, path: str) -> Any:
  for p in path.split("/"):
    tree = tree[p]
  return tree


# ----------------------------------------------------------------------------- JAX side


# Set from the command line: data-axis size (None: one row per process) and how leaves use
# the "data" axis ("mixed" as in _LEAVES; "dp": replicated across it, pure data parallelism).
CONFIG: dict[str, Any] = {"replicas": None, "layout": "mixed", "keys": False}


def _leaf_names() -> list[str]:
  return list(_LEAVES) + (list(_KEY_LEAVES) if CONFIG["keys"] else [])


def _key_array(leaf: str, spec, seed: int, step: int):
  """A PRNG key leaf at `step`: key data a pure function of (leaf, position, seed, step), each
  device's shard wrapped on that device."""
  import jax
  import numpy as np

  impl = _KEY_LEAVES[leaf][0]
  dims = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), spec.dtype)).shape
  shape = tuple(spec.shape) + tuple(dims)
  shards = []
  for device, index in spec.sharding.addressable_devices_indices_map(spec.shape).items():
    index = tuple(index) + (slice(None),) * len(dims)
    data = ((_hash_bits(leaf, shape, index, seed) >> np.uint64(32)) + np.uint64(step)).astype(
        np.uint32)
    shards.append(jax.random.wrap_key_data(jax.device_put(data, device), impl=impl))
  return jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, shards)


def make_mesh():
  """(data, model): data = --replicas (default: process_count), model = the rest."""
  import jax
  import numpy as np

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  replicas = CONFIG["replicas"] or jax.process_count()
  grid = np.array(devices, dtype=object).reshape(replicas, -1)
  return jax.sharding.Mesh(grid, ("data", "model"))


def _dims(mesh) -> tuple[int, int]:
  return mesh.shape["data"], mesh.shape["model"]


def abstract_state(mesh, rows: int) -> dict:
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  data, model = _dims(mesh)
  out: dict[str, Any] = {}
  for leaf, (dtype, axes, shape_fn) in _LEAVES.items():
    if CONFIG["layout"] == "dp":
      axes = tuple(None if a == "data" else a for a in axes)
    sharding = NamedSharding(mesh, PartitionSpec(*axes))
    _set(out, leaf, jax.ShapeDtypeStruct(shape_fn(data, model, rows), dtype, sharding=sharding))
  if CONFIG["keys"]:
    for leaf, (impl, axes, shape_fn) in _KEY_LEAVES.items():
      dtype = jax.eval_shape(lambda impl=impl: jax.random.key(0, impl=impl)).dtype
      sharding = NamedSharding(mesh, PartitionSpec(*axes))
      _set(out, leaf, jax.ShapeDtypeStruct(shape_fn(data, model, rows), dtype,
                                           sharding=sharding))
  return out


def make_state(mesh, rows: int, seed: int, step: int) -> dict:
  import jax

  out: dict[str, Any] = {}
  abstract = abstract_state(mesh, rows)
  for leaf in _LEAVES:
    spec = _get(abstract, leaf)
    array = jax.make_array_from_callback(
        spec.shape, spec.sharding,
        lambda index, leaf=leaf, shape=spec.shape: leaf_values(leaf, shape, index, seed, step))
    _set(out, leaf, array)
  for leaf in _leaf_names()[len(_LEAVES):]:
    _set(out, leaf, _key_array(leaf, _get(abstract, leaf), seed, step))
  return out


def _bits(x):
  import jax
  import numpy as np

  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.ascontiguousarray(np.asarray(x))
  return x.reshape(-1).view(np.uint8)


def compare_state(restored: Any, expected: dict) -> list[str]:
  """Problems found comparing this process's shards of `restored` with `expected` (bit-exact)."""
  import jax
  import numpy as np

  problems = []
  if jax.tree_util.tree_structure(restored) != jax.tree_util.tree_structure(expected):
    return [f"tree structure {jax.tree_util.tree_structure(restored)} != "
            f"{jax.tree_util.tree_structure(expected)}"]
  for leaf in _leaf_names():
    got, want = _get(restored, leaf), _get(expected, leaf)
    if not isinstance(got, jax.Array):
      problems.append(f"{leaf}: restored a {type(got).__name__}, not a jax.Array")
      continue
    if got.dtype != want.dtype or got.shape != want.shape:
      problems.append(f"{leaf}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
      continue
    if got.sharding != want.sharding:
      problems.append(f"{leaf}: sharding {got.sharding} != {want.sharding}")
      continue
    got_shards = {s.device: s for s in got.addressable_shards}
    want_shards = {s.device: s for s in want.addressable_shards}
    if set(got_shards) != set(want_shards):
      problems.append(f"{leaf}: shards on {sorted(map(str, got_shards))}, expected "
                      f"{sorted(map(str, want_shards))}")
      continue
    for device, w in want_shards.items():
      g = got_shards[device]
      if g.index != w.index:
        problems.append(f"{leaf}@{device}: index {g.index} != {w.index}")
      elif not np.array_equal(_bits(g.data), _bits(w.data)):
        problems.append(f"{leaf}@{device}: bytes differ")
  return problems


def _manager(args, mesh, *, exit_after_ondemand_checkpoint: bool | None = None,
             ondemand_grace_seconds: float | None = None):
  import orbax.checkpoint as ocp

  """The manager every sub-command uses; the on-demand options are passed only when given."""
  import orbax_mtc as mtc
  from orbax_mtc import distributed

  local_dir = args.local_dir or distributed.local_directory()
  if not local_dir:
    raise SystemExit("no --local-dir and no ORBAX_MTC_LOCAL_DIR")
  extra: dict[str, Any] = {}
  if exit_after_ondemand_checkpoint is not None:
    extra["exit_after_ondemand_checkpoint"] = exit_after_ondemand_checkpoint
  if ondemand_grace_seconds is not None:
    extra["ondemand_grace_seconds"] = ondemand_grace_seconds
  if getattr(args, "backup_timeout", None):
    extra["async_options"] = ocp.AsyncOptions(timeout_secs=args.backup_timeout)
  if getattr(args, "agreement_timeout", None):
    extra["agreement_timeout_seconds"] = args.agreement_timeout
  if getattr(args, "mode", "standalone") == "managed":
    extra["mode"] = "managed"
    extra["managed"] = mtc.ManagedOptions(peers_per_node=args.managed_peers_per_node,
                                          timeout_seconds=args.managed_timeout,
                                          poll_seconds=0.02)
    extra["job_name"] = args.job_name
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=args.local_interval,
                                       max_to_keep=args.local_keep),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=args.persistent_interval,
                                                 max_to_keep=args.persistent_keep),
      replication=mtc.ReplicationOptions(replica_axis="data",
                                         peers_per_node=args.peers_per_node),
      **extra)
  return mtc.CheckpointManager(local_dir, args.persistent_dir, mesh,
                               abstract_state(mesh, args.rows), options=options)


def _fmt(steps) -> str:
  return ",".join(str(s) for s in sorted(steps)) or "-"


def _restore_and_check(args, mgr, mesh) -> tuple[int | None, bool]:
  """Restores, compares, prints RESULT; returns (step, ok) where ok includes expectations."""
  import jax
  import orbax.checkpoint as ocp

  if args.explicit_args:
    restored = mgr.restore(None, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
  else:
    restored = mgr.restore(None)
  info = mgr.last_restore
  step, tier = (info.step, info.tier) if info is not None else (None, "?")
  problems: list[str] = []
  if restored is None:
    if step is not None:
      problems.append(f"restore returned None but last_restore says step {step}")
  else:
    state = restored.state if isinstance(restored, ocp.args.Composite) else restored
    problems += compare_state(state, make_state(mesh, args.rows, args.seed, step))
  ok = not problems
  expect_ok = True
  if args.expect_step is not None and str(step) != args.expect_step:
    expect_ok = False
  if args.expect_tier is not None and tier != args.expect_tier:
    expect_ok = False
  detail = "; ".join(problems)[:2000].replace("\n", " ") or "-"
  _out(f"RESULT process={jax.process_index()} step={step} tier={tier} ok={int(ok)} "
       f"leaves={len(_LEAVES)} detail={detail}")
  return step, ok and expect_ok


def _committed(args, mgr) -> None:
  """Prints this process's committed local steps and the persistent steps (from the folders)."""
  import jax
  from etils import epath

  from orbax_mtc import local_tier

  folder = epath.Path(args.persistent_dir)
  # Complete steps only: a gs:// step folder counts once Orbax wrote its commit marker.
  persistent = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (
      not args.persistent_dir.startswith("gs://") or (p / "commit_success.txt").exists())
                      ) if folder.is_dir() else []
  _out(f"COMMITTED process={jax.process_index()} "
       f"local={_fmt(local_tier.committed_steps(pathlib.Path(mgr.local_directory)))} "
       f"persistent={_fmt(persistent)}")


_REDUCE: Any = None


def _train_step(state: dict) -> float:
  """A global reduction over every shard: like a training step, an all-reduce across all
  processes, so no process runs more than a step ahead of the others."""
  global _REDUCE
  import jax
  import jax.numpy as jnp

  if _REDUCE is None:
    _REDUCE = jax.jit(lambda tree: sum(jnp.sum(x.astype(jnp.float32))
                                       for x in jax.tree.leaves(tree)
                                       if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))
  return float(_REDUCE(state))


def _save_loop(args, mgr, mesh, start: int, stop: int) -> None:
  import jax
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  me = jax.process_index()
  for step in range(start, stop):
    state = make_state(mesh, args.rows, args.seed, step)
    if not getattr(args, "no_step_collective", False):
      _train_step(state)
    if args.die_at_step == step:
      # Deterministic divergence: every process calls save(step), as a real job does, but
      # the local write of `--die-process` never completes (fault injection: its writer
      # blocks, standing for a node killed mid-write); the others commit `step`. Then that
      # process is SIGKILLed while the others wait (the launcher kills them).
      if me == args.die_process:
        mgr._local.write = lambda *a, **k: threading.Event().wait()
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
      if me != args.die_process:
        # Only the local write: wait_until_finished() would also replicate, a collective the
        # blocked process never joins.
        mgr._wait_local()
        with mgr._persistent_view():
          ocp.CheckpointManager.wait_until_finished(mgr)
      multihost_utils.sync_global_devices(f"mp-worker-die-{step}")
      _committed(args, mgr)
      if me == args.die_process:
        _out(f"DYING process={me} step={step}")
        os.kill(os.getpid(), signal.SIGKILL)
      threading.Event().wait()  # until the launcher kills us
    _out(f"SAVING step={step}")
    saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    if saved and args.land_backups and step % args.persistent_interval == 0:
      # This loop has no compute between saves, so a backup would still be uploading when
      # the next is due and be replaced by it; wait, so every scheduled backup lands.
      mgr.wait_until_finished()
    _out(f"SAVED step={step} saved={int(saved)}")
  mgr.wait_until_finished()
  _committed(args, mgr)


def cmd_save(args) -> int:
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  with _manager(args, mesh) as mgr:
    start, ok = args.start, True
    if args.restore_first:
      step, ok = _restore_and_check(args, mgr, mesh)
      start = 0 if step is None else step + 1
    _save_loop(args, mgr, mesh, start, args.steps)
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_managed_init(args) -> int:
  """GKE-style start: jax.distributed from <local>/jax-init-info.txt (waited for) and the
  replicator handshake by initialize_multi_tier_checkpointing, then restore and save."""
  import jax
  from jax._src import distributed as jax_distributed

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  entry = mtc.initialize_multi_tier_checkpointing(
      distributed.local_directory(), run_name=args.job_name,
      backup_interval_steps=args.persistent_interval, jax_initialization_timeout_seconds=60,
      handshake_timeout_seconds=60, poll_seconds=0.02)
  _out(f"INIT process={jax.process_index()} "
       f"coordinator={jax_distributed.global_state.coordinator_address} entry={entry}")
  mesh = make_mesh()
  with _manager(args, mesh) as mgr:
    step, ok = _restore_and_check(args, mgr, mesh)
    _save_loop(args, mgr, mesh, 0 if step is None else step + 1, args.steps)
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_restore(args) -> int:
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  with _manager(args, mesh) as mgr:
    _, ok = _restore_and_check(args, mgr, mesh)
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_resave(args) -> int:
  """Saves steps [0, --steps), then every process saves again, forced: the newest step after
  --drop-process lost it from RAM (only), then the one before (in RAM everywhere)."""
  import jax
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with _manager(args, mesh) as mgr:
    _save_loop(args, mgr, mesh, 0, args.steps)
    newest = args.steps - 1
    if me == args.drop_process:
      mgr._local.delete(newest)  # this node alone no longer holds it (e.g. a failed write)
    multihost_utils.sync_global_devices("mp-worker-resave")
    for step in (newest, newest - 1):
      state = make_state(mesh, args.rows, args.seed, step)
      try:
        saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)),
                         force=True)
        outcome = f"saved={int(saved)}"
      except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}".replace("\n", " ")
      _out(f"RESAVE process={me} step={step} detail={outcome}")
    mgr.wait_until_finished()
    _out(f"PERSISTENT process={me} steps={_fmt(mgr._persistent_steps())}")
  return 0


def _stream_bytes(source: int, destination: int, nbytes: int):
  import numpy as np

  return np.random.default_rng(1000 * source + destination).integers(
      0, 256, nbytes, dtype=np.uint8)


def cmd_transport(args) -> int:
  """Streams of odd sizes between every process, in small chunks: issued a chunk per call
  (handing arrived chunks over without waiting, as replication does between steps), then the
  rest at once; every received stream must equal what its source sent."""
  import jax
  import numpy as np

  from orbax_mtc import distributed, transport

  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  # Ring both ways plus one long stream; sizes leave a short last chunk in every round.
  sizes = {(i, (i + 1) % n): args.chunk_bytes * (i + 2) + 37 * (i + 1) for i in range(n)}
  sizes |= {((i + 1) % n, i): args.chunk_bytes // 3 + i for i in range(n)}
  sizes[(0, n - 1)] = args.chunk_bytes * 5 + 1
  streams = [transport.Stream(s, d, nbytes) for (s, d), nbytes in sizes.items()]
  received: dict[int, np.ndarray] = {}

  def reader_for(stream):
    data = _stream_bytes(stream.source, stream.destination, stream.nbytes)
    return lambda offset, out: np.copyto(out, data[offset:offset + out.nbytes])

  def sink_for(stream):
    received[stream.source] = np.full(stream.nbytes, 7, np.uint8)

    def sink(offset, data):
      received[stream.source][offset:offset + data.nbytes] = data
    return sink

  transfer = transport.Transfer(streams, me=me, reader_for=reader_for, sink_for=sink_for,
                                chunk_limit=args.chunk_bytes, window=2)
  calls = 0
  while not transfer.done and calls < args.stepwise_calls:
    transfer.retire_ready()
    transfer.advance(1)
    transfer.retire_ready()
    calls += 1
  transfer.run()
  expected = {s.source: s for s in streams if s.destination == me}
  bad = [src for src, stream in expected.items()
         if src not in received or not np.array_equal(
             received[src], _stream_bytes(src, me, stream.nbytes))]
  _out(f"TRANSPORT process={me} streams={len(expected)} bad={bad} calls={calls}")
  return 0 if not bad and sorted(received) == sorted(expected) else EXIT_MISMATCH


def cmd_chaos(args) -> int:
  """Restore + check, then save every step until killed (or --steps more steps)."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  with _manager(args, mesh) as mgr:
    step, ok = _restore_and_check(args, mgr, mesh)
    if not ok:
      return EXIT_MISMATCH
    start = 0 if step is None else step + 1
    _save_loop(args, mgr, mesh, start, start + args.steps)
  _out("DONE")
  return 0


def cmd_plain_restore(args) -> int:
  """Reads the persistent tier with a plain Orbax manager in one process, any device count."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  expected = global_state_numpy(args.seed, args.step, args.data, args.model, args.rows)
  mgr = ocp.CheckpointManager(args.persistent_dir)
  ok = True
  try:
    steps = list(mgr.all_steps())
    if args.step not in steps:
      _out(f"RESULT mode=steps step={args.step} ok=0 detail=steps {steps}")
      return EXIT_MISMATCH
    device = jax.devices()[0]
    targets = {
        "numpy": jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray), expected),
        "device": jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(
                sharding=jax.sharding.SingleDeviceSharding(device),
                global_shape=x.shape, dtype=x.dtype), expected),
    }
    for mode, restore_args in targets.items():
      restored = mgr.restore(args.step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(restore_args=restore_args))).state
      problems = []
      if jax.tree_util.tree_structure(restored) != jax.tree_util.tree_structure(expected):
        problems.append("tree structure differs")
      else:
        for leaf in _LEAVES:
          got, want = _get(restored, leaf), _get(expected, leaf)
          if mode == "device" and not isinstance(got, jax.Array):
            problems.append(f"{leaf}: {type(got).__name__}, not a jax.Array")
            continue
          got = np.asarray(got)
          if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{leaf}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
          elif not np.array_equal(_bits(got), _bits(want)):
            problems.append(f"{leaf}: bytes differ")
      ok = ok and not problems
      _out(f"RESULT mode={mode} devices={jax.device_count()} step={args.step} "
           f"ok={int(not problems)} detail={'; '.join(problems) or '-'}")
  finally:
    mgr.close()
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


_PHASES = ("", "frozen", "held", "up", "stop")


def cmd_outage(args) -> int:
  """Trains and saves every step while the test takes the GCS server away and back.

  Process 0 reads the phase the test writes into --control and every process learns it from
  a broadcast at the same step. Prints `PHASE name=... step=...` when the phase changes and
  `BACKUP step=... state=... at=...` when `mgr.last_backup` changes.
  """
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  control = pathlib.Path(args.control)
  me = jax.process_index()
  mgr = _manager(args, mesh)
  phase, seen, reported = 0, set(), 0
  for step in range(args.max_steps):
    state = make_state(mesh, args.rows, args.seed, step)
    _train_step(state)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    for info in [*list(mgr.backup_history)[reported:], mgr.last_backup]:
      if info is not None and (info.step, info.state) not in seen:
        seen.add((info.step, info.state))
        _out(f"BACKUP step={info.step} state={info.state} at={step}")
    reported = len(mgr.backup_history)
    text = control.read_text().strip() if me == 0 and control.exists() else ""
    code = _PHASES.index(text) if text in _PHASES else 0
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if code != phase:
      phase = code
      _out(f"PHASE name={_PHASES[phase]} step={step}")
    if _PHASES[phase] == "stop":
      break
  mgr.wait_until_finished()
  info = mgr.last_backup
  _out(f"BACKUP step={info.step} state={info.state} at=end")
  mgr.close()
  _committed(args, mgr)
  _out("DONE")
  sys.stdout.flush()
  sys.stderr.flush()
  # orbax-checkpoint 0.12.8 leaves helper threads of a failed save waiting up to its 300 s
  # coordination timeout, and they hold the interpreter at exit; the job's work is done.
  os._exit(0)


HOOK_WAIT_S = 60.0  # a hook waits at most this long for the notice or the go file
_POLL_S = 0.02


def _wait_for_notice(timeout_s: float = HOOK_WAIT_S) -> float | None:
  """Polls `preemption.notice_time()` until the job's SIGTERM is known, at most `timeout_s`."""
  from orbax_mtc import preemption

  deadline = time.monotonic() + timeout_s
  while True:
    notice = preemption.notice_time()
    if notice is not None or time.monotonic() >= deadline:
      return notice
    time.sleep(_POLL_S)


def _wait_for_file(path: pathlib.Path, timeout_s: float = HOOK_WAIT_S) -> bool:
  deadline = time.monotonic() + timeout_s
  while not path.exists():
    if time.monotonic() >= deadline:
      return False
    time.sleep(_POLL_S)
  return True


def _install_write_hook(args, mgr, me: int, ondemand_steps: set[int]) -> None:
  """Wraps this process's local writer (it runs on the manager's writer thread).

  write: the write of --hook-step first prints HOOK-WRITING and waits until the preemption
    notice is known (the test sends SIGTERM when it sees the line), so the notice lands while
    an ordinary save is being written.
  ondemand-write: the first write of a step whose `reached_preemption` was True prints
    HOOK-ONDEMAND and waits for `<marker-dir>/go`, so the test can signal again meanwhile.
  """
  real = mgr._local.write
  done: set[int] = set()

  def write(staged, *rest, **kwargs):
    step = getattr(staged, "step", None)
    if step not in done:
      if args.hook == "write" and step == args.hook_step:
        done.add(step)
        _out(f"HOOK-WRITING process={me} step={step}")
        notice = _wait_for_notice()
        _out(f"HOOK-NOTICE process={me} step={step} known={int(notice is not None)}")
      elif args.hook == "ondemand-write" and step in ondemand_steps:
        done.add(step)
        _out(f"HOOK-ONDEMAND process={me} step={step}")
        found = _wait_for_file(pathlib.Path(args.marker_dir) / "go")
        _out(f"HOOK-GO process={me} step={step} found={int(found)}")
    return real(staged, *rest, **kwargs)

  mgr._local.write = write


def _install_restore_hook(mgr, me: int) -> None:
  """The first read of a RAM step inside restore() prints HOOK-RESTORING and waits until the
  preemption notice is known (the test sends SIGTERM when it sees the line)."""
  from orbax_mtc import local_tier

  fired: list[bool] = []

  def hooked(fn):
    def wrapper(*a, **k):
      if not fired:
        fired.append(True)
        _out(f"HOOK-RESTORING process={me}")
        notice = _wait_for_notice()
        _out(f"HOOK-NOTICE process={me} known={int(notice is not None)}")
      return fn(*a, **k)
    return wrapper

  if hasattr(mgr, "_try_local"):
    mgr._try_local = hooked(mgr._try_local)
  else:  # the manager was restructured: hook the read itself
    local_tier.read_data = hooked(local_tier.read_data)


def _ondemand_fields(mgr) -> str:
  info = getattr(mgr, "last_ondemand", None)
  if info is None:
    return "info=none"
  return (f"info_step={info.step} persistent={int(bool(info.persistent))} "
          f"total={info.seconds.get('total', -1):.3f}")


def cmd_preempt(args) -> int:
  """Train and save until a preemption notice (SIGTERM) makes every process save on demand.

  Steps run 0, K, 2K, ... (K = --stride) or, after a restore of step R, R+K, R+2K, ...; each
  is a training step (an all-reduce), `reached_preemption(step)`, then `save(step)`. At the
  step all processes agreed on (`reached_preemption` True) the save is the on-demand one:
    --exit-after  the manager exits the process (status 0) inside that save();
    --self-exit   the loop stops once `mgr.should_exit()` says so (EXITING);
    otherwise     training goes on for --after-steps more steps (DONE).
  Every `reached_preemption` is asked twice (before and after save) and must not change.
  """
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  if args.exit_after and args.self_exit:
    print("--exit-after and --self-exit exclude each other", file=sys.stderr)
    return EXIT_USAGE
  if args.hook == "ondemand-write" and not args.marker_dir:
    print("--hook ondemand-write needs --marker-dir", file=sys.stderr)
    return EXIT_USAGE
  if args.hook == "write" and args.hook_step is None:
    print("--hook write needs --hook-step", file=sys.stderr)
    return EXIT_USAGE
  if args.stride < 1 or args.max_steps < 1 or args.after_steps < 0:
    print("--stride and --max-steps must be >= 1, --after-steps >= 0", file=sys.stderr)
    return EXIT_USAGE

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ondemand_steps: set[int] = set()
  with _manager(args, mesh, exit_after_ondemand_checkpoint=True if args.exit_after else None,
                ondemand_grace_seconds=args.grace_seconds) as mgr:
    if args.hook == "restore":
      _install_restore_hook(mgr, me)
    restored, ok = _restore_and_check(args, mgr, mesh)
    if not ok:
      return EXIT_MISMATCH
    if args.hook in ("write", "ondemand-write"):
      _install_write_hook(args, mgr, me, ondemand_steps)
    step = 0 if restored is None else restored + args.stride
    preempted_at: int | None = None
    ready = False
    for _ in range(args.max_steps):
      state = make_state(mesh, args.rows, args.seed, step)
      _train_step(state)
      pre = mgr.reached_preemption(step)
      if pre:
        if preempted_at is not None:
          _out(f"ERROR process={me} step={step} detail=second sync point (first at "
               f"{preempted_at})")
          return EXIT_BAD_ONDEMAND
        preempted_at = step
        ondemand_steps.add(step)
        _out(f"PREEMPTED process={me} step={step}")
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
      if not ready:
        ready = True
        _out(f"READY process={me} step={step}")
      again = mgr.reached_preemption(step)
      if again != pre:
        _out(f"ERROR process={me} step={step} detail=reached_preemption said {pre} before "
             f"save and {again} after")
        return EXIT_BAD_ONDEMAND
      if pre:
        _out(f"ONDEMAND-SAVED process={me} step={step} {_ondemand_fields(mgr)}")
        if args.exit_after:
          _out(f"ERROR process={me} step={step} detail=save() returned under "
               "exit_after_ondemand_checkpoint")
          return EXIT_BAD_ONDEMAND
      if args.self_exit:
        if mgr.should_exit():
          mgr.wait_until_finished()
          _out(f"EXITING process={me} step={step}")
          return 0
        if pre:
          _out(f"ERROR process={me} step={step} detail=should_exit() False after the "
               "on-demand save")
          return EXIT_BAD_ONDEMAND
      elif preempted_at is not None and step >= preempted_at + args.after_steps * args.stride:
        mgr.wait_until_finished()
        _committed(args, mgr)
        _out(f"DONE process={me} step={step}")
        return 0
      step += args.stride
  _out(f"NO-PREEMPTION process={me} step={step}")
  return EXIT_NO_PREEMPTION


def _raised(error: BaseException) -> None:
  import jax

  text = f"{error}".replace("\n", " ")[:1500]
  _out(f"RAISED process={jax.process_index()} type={type(error).__name__} detail={text}")


def cmd_steps(args) -> int:
  """Prints all_steps()/latest_step(), then restores each of --restore-steps ('latest' is
  `mgr.latest_step()`, Orbax's and MaxText's resume idiom) with explicit args and compares."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with _manager(args, mesh) as mgr:
    _out(f"STEPS process={me} all={_fmt(mgr.all_steps())} latest={mgr.latest_step()}")
    for wanted in args.restore_steps.split(","):
      step = mgr.latest_step() if wanted == "latest" else int(wanted)
      restored = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract_state(mesh, args.rows))))
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
      ok = ok and not problems
      detail = "; ".join(problems)[:500] or "-"
      _out(f"RESULT process={me} step={mgr.last_restore.step} tier={mgr.last_restore.tier} "
           f"ok={int(not problems)} leaves={len(_LEAVES)} detail={detail}")
    _out(f"STEPS-AFTER process={me} all={_fmt(mgr.all_steps())} latest={mgr.latest_step()}")
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_mismatch(args) -> int:
  """restore(None) with the shardings of another mesh layout (same shapes and dtypes: the
  device order of the mesh reversed); prints what it raised, then the folders."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[::-1]
  other = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(mesh.devices.shape),
                            mesh.axis_names)
  with _manager(args, mesh) as mgr:
    try:
      mgr.restore(None, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=abstract_state(other, args.rows))))
      _out(f"RESTORED process={jax.process_index()} step={mgr.last_restore.step}")
    except Exception as e:  # noqa: BLE001 - reported to the test
      _raised(e)
    _committed(args, mgr)
  _out("DONE")
  return 0


_FAULT_PHASES = ("write", "commit", "readback", "send", "restore-read", "writeback", "kill")


def _install_fault(args, mgr, me: int) -> None:
  """Makes --fault-process fail in --phase (at --fault-step where a step applies)."""
  import errno

  from orbax_mtc import local_tier, peer_store

  if me != args.fault_process:
    return
  phase, at = args.phase, args.fault_step
  if phase == "kill":
    write = mgr._local.write

    def dying_write(staged, *rest, **kwargs):
      if staged.step == at:  # killed mid-save: the step is never committed here
        _out(f"DYING process={me} step={at}")
        os.kill(os.getpid(), signal.SIGKILL)
      return write(staged, *rest, **kwargs)
    mgr._local.write = dying_write
  elif phase in ("write", "writeback"):
    write = mgr._local.write
    first = {"done": False}

    def failing_write(staged, *rest, **kwargs):
      # writeback: the first write after the restore (the recovered step written back).
      if (phase == "write" and staged.step == at) or (phase == "writeback" and not first["done"]):
        first["done"] = True
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
      first["done"] = True
      return write(staged, *rest, **kwargs)
    mgr._local.write = failing_write
  elif phase == "commit":
    on_commit = mgr._local._on_commit

    def failing_commit(step):
      if step == at:
        raise PermissionError(errno.EACCES, "LKG link not writable (injected)")
      return on_commit(step)
    mgr._local._on_commit = failing_commit
  elif phase == "readback":
    read = mgr._read_for_backup

    def failing_read(pending):
      if pending.step == at:
        raise local_tier.CorruptStepError("read-back failed (injected)")
      return read(pending)
    mgr._read_for_backup = failing_read
  elif phase == "send":
    copy_stream = peer_store.copy_stream

    def failing_stream(step_dir, manifest, *rest, **kwargs):
      if manifest.step == at:
        raise RuntimeError("peer copy read failed (injected)")
      return copy_stream(step_dir, manifest, *rest, **kwargs)
    peer_store.copy_stream = failing_stream
  elif phase == "restore-read":
    read_data = local_tier.read_data

    def failing_read_data(*a, **k):
      raise RuntimeError("restore read failed (injected)")
    local_tier.read_data = failing_read_data
    mgr._restore_read_fault = read_data  # undone after the restore


def cmd_fault(args) -> int:
  """Restores if asked, injects one fault on --fault-process (see _install_fault), saves
  steps up to --steps; prints RAISED for an exception the manager raised, then the folders."""
  import jax

  from orbax_mtc import distributed, local_tier

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  code = 0
  with _manager(args, mesh) as mgr:
    _install_fault(args, mgr, me)
    start = 0
    try:
      if args.restore_first:
        step, ok = _restore_and_check(args, mgr, mesh)
        code = 0 if ok else EXIT_MISMATCH
        start = 0 if step is None else step + 1
        if getattr(mgr, "_restore_read_fault", None) is not None:
          local_tier.read_data = mgr._restore_read_fault
      _save_loop(args, mgr, mesh, start, args.steps)
    except Exception as e:  # noqa: BLE001 - reported to the test
      _raised(e)
      _committed(args, mgr)
      # The error may leave an agreement behind on purpose (a write that failed): close
      # without waiting for more, as a training job that dies on this error would.
      os._exit(7)
  _out("DONE")
  return code


def cmd_force_old(args) -> int:
  """Saves steps [0, --steps), then every process forces a save of the older --old-step;
  prints what save returned, the step lists and this node's LKG links."""
  import jax
  import orbax.checkpoint as ocp

  from orbax_mtc import distributed, lkg

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  with _manager(args, mesh) as mgr:
    _save_loop(args, mgr, mesh, 0, args.steps)
    state = make_state(mesh, args.rows, args.seed, args.old_step)
    saved = mgr.save(args.old_step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)),
                     force=True)
    mgr.wait_until_finished()
    folder = pathlib.Path(mgr.local_directory)
    links = ",".join(f"{e.step}->{os.readlink(folder / e.name)}"
                     for e in lkg.list_entries(folder)) or "-"
    _out(f"FORCED process={me} saved={int(saved)} all={_fmt(mgr.all_steps())} links={links}")
    _committed(args, mgr)
  _out("DONE")
  return 0


def cmd_mirror(args) -> int:
  """The parent-style form with a RAM tier that mirrors the parent's steps (Orbax keeps one:
  max_to_keep=1) and peer copies moved in 1 MiB chunks: saves [0, --steps) (restoring
  first if --restore-first), then prints the folders and the peer copies held."""
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed, replication

  # One save() call moves 1 MiB of copies here (not 128 MiB), so a step's copies are still
  # on their way during the next saves, as a large model's are.
  replication._BYTES_PER_CALL = 1 << 20
  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  ok = True
  with mtc.CheckpointManager(
      args.persistent_dir,
      options=ocp.CheckpointManagerOptions(max_to_keep=1, save_interval_steps=1),
      local_directory=distributed.local_directory(), global_mesh=mesh,
      replication_options=mtc.ReplicationOptions(replica_axis="data", chunk_mib=1)) as mgr:
    start = 0
    if args.restore_first:
      step = mgr.latest_step()
      restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract_state(mesh, args.rows))))
      problems = compare_state(restored.state, make_state(mesh, args.rows, args.seed, step))
      ok = not problems
      _out(f"RESULT process={me} step={step} tier={mgr.last_restore.tier} ok={int(ok)} "
           f"leaves={len(_LEAVES)} detail={'; '.join(problems)[:300] or '-'}")
      start = step + 1
    for step in range(start, args.steps):
      state = make_state(mesh, args.rows, args.seed, step)
      _train_step(state)
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mgr.wait_until_finished()
    copies = ",".join(f"{a}:{b}" for a, b in mgr._store.copies()) or "-"
    _out(f"MIRROR process={me} all={_fmt(mgr.all_steps())} copies={copies}")
    _committed(args, mgr)
  _out("DONE")
  return 0 if ok else EXIT_MISMATCH


def cmd_open(args) -> int:
  """Only opens the manager (on --local-dir, which may be shared by mistake) and closes it."""
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  try:
    with _manager(args, mesh):
      pass
  except Exception as e:  # noqa: BLE001 - reported to the test
    _raised(e)
    return 7
  _out("DONE")
  return 0


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)

  def common(p):
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=8,
                   help="rows of params/w per process (256 bytes each)")
    p.add_argument("--persistent-dir", required=True)
    p.add_argument("--local-dir", default=None, help="default: ORBAX_MTC_LOCAL_DIR")
    p.add_argument("--local-interval", type=int, default=2)
    p.add_argument("--local-keep", type=int, default=2)
    p.add_argument("--persistent-interval", type=int, default=4)
    p.add_argument("--persistent-keep", type=int, default=None)
    p.add_argument("--explicit-args", action="store_true",
                   help="restore with Composite(state=PyTreeRestore(item=abstract))")
    p.add_argument("--expect-step", default=None, help="a step number, or 'None'")
    p.add_argument("--expect-tier", default=None,
                   choices=("local", "peer", "persistent", "none", "replicator"))
    p.add_argument("--mode", choices=("standalone", "managed"), default="standalone",
                   help="managed: GKE's replicator protocol (tests run a simulator)")
    p.add_argument("--managed-peers-per-node", type=int, default=None)
    p.add_argument("--managed-timeout", type=float, default=60.0)
    p.add_argument("--job-name", default="orbax")
    p.add_argument("--replicas", type=int, default=None,
                   help="size of the mesh's data axis (default: one row per process)")
    p.add_argument("--layout", choices=("mixed", "dp"), default="mixed",
                   help="dp: every leaf replicated across the data axis")
    p.add_argument("--keys", action="store_true",
                   help="typed PRNG key leaves in the state too (rngs/...)")
    p.add_argument("--peers-per-node", type=int, default=None)
    p.add_argument("--no-land-backups", dest="land_backups", action="store_false",
                   help="do not wait for each scheduled backup to land")
    p.add_argument("--backup-timeout", type=int, default=None,
                   help="AsyncOptions.timeout_secs of the persistent tier")
    p.add_argument("--agreement-timeout", type=float, default=None,
                   help="CheckpointManagerOptions.agreement_timeout_seconds")
    return p

  p = common(sub.add_parser("save"))
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--steps", type=int, required=True, help="save steps [start, steps)")
  p.add_argument("--restore-first", action="store_true")
  p.add_argument("--die-at-step", type=int, default=None)
  p.add_argument("--die-process", type=int, default=1)
  p.set_defaults(fn=cmd_save)

  p = common(sub.add_parser("restore"))
  p.set_defaults(fn=cmd_restore)

  p = common(sub.add_parser("managed-init"))
  p.add_argument("--steps", type=int, required=True, help="save steps up to this one")
  p.set_defaults(fn=cmd_managed_init, die_at_step=None, die_process=None)

  p = common(sub.add_parser("steps"))
  p.add_argument("--restore-steps", default="latest",
                 help="comma-separated steps to restore in turn; 'latest': mgr.latest_step()")
  p.set_defaults(fn=cmd_steps)

  p = common(sub.add_parser("mismatch"))
  p.set_defaults(fn=cmd_mismatch)

  p = common(sub.add_parser("fault"))
  p.add_argument("--phase", choices=_FAULT_PHASES, required=True)
  p.add_argument("--fault-process", type=int, default=1)
  p.add_argument("--fault-step", type=int, default=None)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--restore-first", action="store_true")
  p.add_argument("--no-step-collective", action="store_true",
                 help="no global reduction per step: the manager's agreements are the only "
                 "collectives (a dead process is then noticed there, not in a training step)")
  p.set_defaults(fn=cmd_fault, die_at_step=None, die_process=None)

  p = common(sub.add_parser("force-old"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--old-step", type=int, required=True)
  p.set_defaults(fn=cmd_force_old, die_at_step=None, die_process=None)

  p = common(sub.add_parser("mirror"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--restore-first", action="store_true")
  p.set_defaults(fn=cmd_mirror)

  p = common(sub.add_parser("open"))
  p.set_defaults(fn=cmd_open)

  p = common(sub.add_parser("chaos"))
  p.add_argument("--steps", type=int, default=10_000, help="steps to save after the restore")
  p.set_defaults(fn=cmd_chaos, die_at_step=None, die_process=None)

  p = sub.add_parser("plain-restore")
  p.add_argument("--persistent-dir", required=True)
  p.add_argument("--step", type=int, required=True)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--data", type=int, required=True, help="data axis size when saved")
  p.add_argument("--model", type=int, required=True, help="model axis size when saved")
  p.set_defaults(fn=cmd_plain_restore)

  p = common(sub.add_parser("resave"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--drop-process", type=int, default=1)
  p.set_defaults(fn=cmd_resave, die_at_step=None, die_process=None)

  p = sub.add_parser("transport")
  p.add_argument("--chunk-bytes", type=int, default=16384)
  p.add_argument("--stepwise-calls", type=int, default=6,
                 help="calls that issue one chunk each before the rest is run at once")
  p.set_defaults(fn=cmd_transport)

  p = common(sub.add_parser("outage"))
  p.add_argument("--control", required=True, help="file holding the phase the test sets")
  p.add_argument("--max-steps", type=int, default=20_000)
  p.set_defaults(fn=cmd_outage)

  p = common(sub.add_parser("preempt"))
  p.add_argument("--stride", type=int, default=1, help="steps 0, K, 2K, ... after the restore")
  p.add_argument("--max-steps", type=int, default=200_000,
                 help="give up (exit 5) after this many steps without a preemption")
  p.add_argument("--exit-after", action="store_true",
                 help="exit_after_ondemand_checkpoint=True: save() ends the process")
  p.add_argument("--self-exit", action="store_true",
                 help="stop when mgr.should_exit() says so after a save")
  p.add_argument("--after-steps", type=int, default=0,
                 help="without an exit mode: steps trained after the on-demand save")
  p.add_argument("--grace-seconds", type=float, default=None,
                 help="ondemand_grace_seconds (default: the manager's)")
  p.add_argument("--hook", choices=("none", "write", "ondemand-write", "restore"),
                 default="none")
  p.add_argument("--hook-step", type=int, default=None, help="the step --hook write holds")
  p.add_argument("--marker-dir", default=None, help="where --hook ondemand-write looks for go")
  p.set_defaults(fn=cmd_preempt)
  return parser


def main(argv: list[str] | None = None) -> int:
  import logging

  # Without Google credentials (the loopback GCS server) gcsfs warns on every bucket access.
  logging.getLogger("gcsfs").setLevel(logging.ERROR)
  args = _parser().parse_args(argv)
  CONFIG.update(keys=getattr(args, "keys", False),
                replicas=getattr(args, "replicas", None),
                layout=getattr(args, "layout", "mixed"))
  return args.fn(args)


# ----------------------------------------------------------------------------- test helpers

_LINE = re.compile(r"^(?:\[node (\d+)\] )?.*?" + re.escape(MARK) + r" ([\w-]+) ?(.*)$")


class LineCollector:
  """A text stream for `Job(output=...)` that keeps every line and lets a test wait for one."""

  def __init__(self):
    self._cond = threading.Condition()
    self._partial = ""
    self.lines: list[str] = []

  def write(self, text: str) -> int:
    with self._cond:
      text = self._partial + text
      *complete, self._partial = text.split("\n")
      self.lines.extend(complete)
      if complete:
        self._cond.notify_all()
    return len(text)

  def flush(self) -> None:
    pass

  def text(self) -> str:
    with self._cond:
      return "\n".join(self.lines + ([self._partial] if self._partial else []))

  def wait_for(self, predicate, timeout_s: float) -> bool:
    """Waits until predicate(lines) is true; False on timeout."""
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while not predicate(self.lines):
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
      return True


def events(lines: list[str], kind: str) -> list[tuple[int, dict[str, str]]]:
  """(node, {key: value}) of every `[node i] @@mtc KIND k=v ...` line (detail= takes the rest).

  Lines without the launcher's `[node i] ` prefix (a process run alone) count as node 0.
  """
  out = []
  for line in lines:
    m = _LINE.match(line)
    if not m or m.group(2) != kind:
      continue
    rest, fields = m.group(3), {}
    if " detail=" in rest or rest.startswith("detail="):
      rest, _, fields["detail"] = rest.partition("detail=")
    for token in rest.split():
      key, _, value = token.partition("=")
      fields[key] = value
    out.append((int(m.group(1) or 0), fields))
  return out


def parse_results(lines: list[str]) -> dict[int, dict[str, str]]:
  """node -> fields of its last RESULT line."""
  return {node: fields for node, fields in events(lines, "RESULT")}


if __name__ == "__main__":
  sys.exit(main())
