"""Sub-commands off the manager's usual path: plain-restore (a plain Orbax manager reads the
persistent tier), transport (the chunked byte streams between processes), managed-init (the
GKE-style start), parent-resume (the parent-style form's resume)."""

from __future__ import annotations

from orbax_mtc import testing

from . import hooks
from .common import (
  EXIT_MISMATCH,
  abstract_state,
  compare_state,
  make_mesh,
  make_state,
  manager,
  restore_and_check,
  save_loop,
)
from .events import emit


def cmd_plain_restore(args) -> int:
  """Reads the persistent tier with a plain Orbax manager in one process, any device count:
  to numpy, then to one device; both compared bit for bit with the global state."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  expected = testing.global_state_numpy(args.seed, args.step, args.data, args.model, args.rows)
  mgr = ocp.CheckpointManager(args.persistent_dir)
  ok = True
  try:
    steps = list(mgr.all_steps())
    if args.step not in steps:
      emit(f"RESULT mode=steps step={args.step} ok=0 detail=steps {steps}")
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
      problems = testing.host_differences(restored, expected, jax_arrays=mode == "device")
      ok = ok and not problems
      emit(f"RESULT mode={mode} devices={jax.device_count()} step={args.step} "
           f"ok={int(not problems)} detail={'; '.join(problems) or '-'}")
  finally:
    mgr.close()
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


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

  calls_made = {"read": 0, "place": 0, "sink": 0}
  faulty = me == 1 and args.fault != "none"

  def failing(kind: str) -> bool:
    calls_made[kind] += 1
    return faulty and args.fault == kind and calls_made[kind] >= 3

  def reader_for(stream):
    data = _stream_bytes(stream.source, stream.destination, stream.nbytes)

    def read(offset, out):
      if failing("read"):
        raise OSError(5, "Input/output error (injected)")
      np.copyto(out, data[offset:offset + out.nbytes])
    return read

  def sink_for(stream):
    received[stream.source] = np.full(stream.nbytes, 7, np.uint8)

    def sink(offset, data):
      if failing("sink"):
        raise MemoryError("no room for the received chunk (injected)")
      received[stream.source][offset:offset + data.nbytes] = data
    return sink

  place = transport.place

  def placing(buffer, devices):
    if failing("place"):
      raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory (injected)")
    return place(buffer, devices)
  transport.place = placing

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
  emit(f"TRANSPORT process={me} streams={len(expected)} bad={bad} calls={calls} "
       f"failures={len(transfer.failures)}")
  if args.fault != "none":
    return 0  # the test judges which streams may be bad
  return 0 if not bad and sorted(received) == sorted(expected) else EXIT_MISMATCH


def cmd_chunk_race(args) -> int:
  """Round after round, a peer chunk left moving (as `save()` leaves them) and then a
  training step whose all-reduce spans every device: JAX's CPU client must start the two in
  the same order on every process (node_mesh.py). With a one-device chunk beside a
  two-device step, jobs hung within about 50 rounds. Every stream and the state are checked."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from orbax_mtc import distributed, transport

  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  mesh = Mesh(np.array(jax.devices()), ("devices",))
  spec = PartitionSpec("devices")
  train_step = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "devices") + 1.0, mesh=mesh,
                                     in_specs=spec, out_specs=spec))
  state = jax.device_put(jnp.zeros(jax.device_count() * 256, jnp.float32),
                         NamedSharding(mesh, spec))
  streams = [transport.Stream(i, (i + 1) % n, 2 * args.chunk_bytes + 37) for i in range(n)]
  sent = {s: _stream_bytes(s.source, s.destination, s.nbytes) for s in streams}
  received: dict[int, np.ndarray] = {}

  def reader_for(stream):
    return lambda offset, out: np.copyto(out, sent[stream][offset:offset + out.nbytes])

  def sink_for(stream):
    received[stream.source] = np.zeros(stream.nbytes, np.uint8)

    def sink(offset, data):
      received[stream.source][offset:offset + data.nbytes] = data
    return sink

  bad = 0
  for _ in range(args.rounds):
    transfer = transport.Transfer(streams, me=me, reader_for=reader_for, sink_for=sink_for,
                                  chunk_limit=args.chunk_bytes, window=8)
    transfer.advance(None, window=8)  # every chunk left moving
    state = train_step(state)
    transfer.retire_finished()
    incoming = next(s for s in streams if s.destination == me)
    bad += not np.array_equal(received[incoming.source], sent[incoming])
  steps_ok = bool(np.all(np.asarray(state.addressable_shards[0].data) == args.rounds))
  emit(f"RACE process={me} devices={jax.local_device_count()} rounds={args.rounds} "
       f"bad={bad} state={int(steps_ok)}")
  return 0 if not bad and steps_ok else EXIT_MISMATCH


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
  emit(f"INIT process={jax.process_index()} "
       f"coordinator={jax_distributed.global_state.coordinator_address} entry={entry}")
  mesh = make_mesh()
  with manager(args, mesh) as mgr:
    step, ok = restore_and_check(args, mgr, mesh)
    save_loop(args, mgr, mesh, 0 if step is None else step + 1, args.steps)
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH


def _census_records(n: int, case: str):
  """Every process's save facts, the same on every process: node 1 lost its folder (a twin
  or a copy covers it); in case `faults` two processes report an error."""
  from orbax_mtc.agreement import Fault, Inventory, SaveRecord

  records = []
  for p in range(n):
    own = [] if p == 1 else [10, 20, 2 ** 40]
    inv = Inventory.of(own, [((p + 1) % n, 20)], [10] if p else [10, 5])
    fault = Fault(kind="OSError", message=f"disk {p} full") if case == "faults" and p % 2 \
        else Fault()
    records.append(SaveRecord(step=30, fault=fault, inventory=inv, has_step_in_ram=p == 2,
                              orbax_busy=p == 0, clock_ms=1_790_000_000_000 + p))
  return records


def cmd_reduce(args) -> int:
  """The save agreement's rounds through the real collectives (node_mesh.py), gathered
  (small rounds, the default) and all-reduced (no round gathered): each process's answer
  equals the one simulated from every record."""
  import jax

  from orbax_mtc import collectives, distributed, reduction, save_census

  distributed.initialize()
  me, n = jax.process_index(), jax.process_count()
  same = True
  gathered_bytes = reduction.GATHERED_ROUND_BYTES
  for path, case in [(p, c) for p in ("gathered", "reduced") for c in ("plain", "faults")]:
    reduction.GATHERED_ROUND_BYTES = gathered_bytes if path == "gathered" else 0
    records = _census_records(n, case)
    real = save_census.agree(
        records[me], me, n, None, [10], [10],
        lambda rnd: collectives.allreduce(rnd.parts(), "a test agreement", n, 60))
    simulated = save_census.agree(
        records[me], me, n, None, [10], [10],
        lambda rnd, records=records: reduction.combine(
            rnd.contribute(r, p) for p, r in enumerate(records)))
    fields = ("ram", "floor", "persistent", "persistent_seen", "local", "local_count",
              "backup", "steps_error")
    same &= all(getattr(real, f) == getattr(simulated, f) for f in fields)
    same &= real.census.clock_ms == 1_790_000_000_000 and real.census.busy.lowest == 0
    emit(f"REDUCE process={me} case={case} path={path} devices={jax.local_device_count()} "
         f"same={int(same)} rounds={len(real.rounds)} ram={list(real.ram)} "
         f"faulty={sorted(real.local)}")
  return 0 if same else EXIT_MISMATCH


def cmd_parent_resume(args) -> int:
  """The parent-style form (`ocp.CheckpointManager`'s constructor plus a RAM tier) resumed as
  Orbax users do: `restore(latest_step())` (compared, RESULT), then save every step up to
  --steps (SAVING/SAVED lines); --phase injects a fault as the fault sub-command does.
  --die-after: killed before that step's peer copies start (they start at the next save)."""
  import os
  import pathlib

  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = make_mesh()
  me = jax.process_index()
  mgr = mtc.CheckpointManager(
      args.persistent_dir, options=ocp.CheckpointManagerOptions(save_interval_steps=1,
                                                                max_to_keep=3),
      local_directory=os.environ["ORBAX_MTC_LOCAL_DIR"])
  if args.phase is not None:
    hooks.install_fault(args, mgr, me)
  ok = True
  with mgr:
    latest = mgr.latest_step()
    if latest is not None:
      restored = mgr.restore(latest, args=ocp.args.StandardRestore(
          abstract_state(mesh, args.rows)))
      problems = compare_state(restored, make_state(mesh, args.rows, args.seed, latest))
      ok = not problems
      info = mgr.last_restore  # set by a restore from RAM only; else Orbax served it
      tier = info.tier if info is not None and info.step == latest else "persistent"
      emit(f"RESULT process={me} step={latest} tier={tier} ok={int(ok)} "
           f"detail={'; '.join(problems)[:500] or '-'}")
    for step in range(args.start if latest is None else latest + 1, args.steps):
      emit(f"SAVING step={step}")
      saved = mgr.save(step, args=ocp.args.StandardSave(make_state(mesh, args.rows, args.seed,
                                                                   step)))
      emit(f"SAVED step={step} saved={int(saved)}")
      if step == args.die_after:
        hooks.die_once_committed(pathlib.Path(os.environ["ORBAX_MTC_LOCAL_DIR"]) / str(step),
                                 pathlib.Path(args.persistent_dir) / str(step))
    mgr.wait_until_finished()
  emit("DONE")
  return 0 if ok else EXIT_MISMATCH
