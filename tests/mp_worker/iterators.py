"""The iterate and plain-iterate sub-commands: training that reads real Grain data, saving the
data iterator's position and a per-process JSON item beside the state in every tier.

Each process reads its own shard of a Grain `DataLoader` (`data_loader`, also used by the
tests to compute the batches an uninterrupted run reads). Step s consumes batch s and saves
`Composite(state=..., iter=grain CheckpointSave(iterator), pos=ProcessJsonSave({...}))`, the
iterator positioned after batch s. After a restore of step S, the next batch must be batch
S + 1 of this process's shard.

Events: RESUMED process= step= tier= ok= next= detail= (after the restore; next= the first
batch read after it, comma-separated), BATCH process= step= values=, CHECKPOINTED step= (every
process, once step --hold-at is committed in every tier asked and copied to peers), and the
preempt sub-command's READY / PREEMPTED lines.
"""

from __future__ import annotations

import sys
from typing import Any

from . import common
from .events import emit

RECORDS = 1 << 16  # 8192 batches per process: more than a preempted run reaches
BATCH = 4
SEED = 7


def data_loader(process: int, count: int) -> Any:
  """This process's shard of the data: shuffled indices, batches of BATCH, one epoch."""
  import grain

  shard = grain.sharding.ShardOptions(shard_index=process, shard_count=count,
                                      drop_remainder=True)
  sampler = grain.samplers.IndexSampler(num_records=RECORDS, shard_options=shard, shuffle=True,
                                        num_epochs=1, seed=SEED)
  return grain.DataLoader(
      data_source=grain.sources.RangeDataSource(0, RECORDS, 1), sampler=sampler,
      operations=[grain.transforms.Batch(batch_size=BATCH, drop_remainder=True)],
      worker_count=0, shard_options=shard)


def _csv(batch: Any) -> str:
  return ",".join(str(int(x)) for x in batch)


def _position(step: int, me: int) -> dict:
  return {"step": step, "process": me, "note": f"after batch {step}"}


def _restore(args, mgr, mesh, iterator) -> tuple[int | None, bool]:
  """restore(None) with the iterator; prints RESUMED. Returns (step, ok)."""
  import grain
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  me = jax.process_index()
  restored = mgr.restore(None, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=common.abstract_state(mesh, args.rows)),
      iter=grain.checkpoint.CheckpointRestore(iterator), pos=mtc.ProcessJsonRestore()))
  info = mgr.last_restore
  step, tier = (info.step, info.tier) if info is not None else (None, "none")
  problems: list[str] = []
  if restored is not None:
    problems += common.compare_state(restored.state,
                                     common.make_state(mesh, args.rows, args.seed, step))
    if restored.iter is not iterator:
      problems.append("restore did not return the iterator it was given")
    if restored.pos != _position(step, me):
      problems.append(f"pos {restored.pos} != {_position(step, me)}")
  ok = not problems
  expect_ok = (args.expect_step is None or str(step) == args.expect_step) and (
      args.expect_tier is None or tier == args.expect_tier)
  emit(f"RESUMED process={me} step={step} tier={tier} ok={int(ok)} "
       f"detail={'; '.join(problems)[:1500] or '-'}")
  return step, ok and expect_ok


def cmd_iterate(args) -> int:
  """Restore (if anything), then train steps until --steps, saving each; see module doc.

  --hold-at K: after saving step K, wait until it is committed everywhere (RAM, peers, the
  persistent tier if due), print CHECKPOINTED, and wait there to be killed (so K is the
  newest step whatever the kill's timing).
  --preempt: save on demand at the step every process agrees on after a SIGTERM, and exit
  there (exit_after_ondemand_checkpoint); READY after the first save.
  """
  import threading

  import grain
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = common.make_mesh()
  me, count = jax.process_index(), jax.process_count()
  iterator = iter(data_loader(me, count))
  with common.manager(args, mesh,
                      exit_after_ondemand_checkpoint=True if args.preempt else None) as mgr:
    restored, ok = _restore(args, mgr, mesh, iterator)
    if not ok:
      return common.EXIT_MISMATCH
    step = 0 if restored is None else restored + 1
    first = True
    while step < args.steps:
      batch = next(iterator)
      if first:
        emit(f"NEXT process={me} step={step} values={_csv(batch)}")
        first = False
      emit(f"BATCH process={me} step={step} values={_csv(batch)}")
      state = common.make_state(mesh, args.rows, args.seed, step)
      common.train_step(state)
      if args.preempt and mgr.reached_preemption(step):
        emit(f"PREEMPTED process={me} step={step}")
      mgr.save(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state), iter=grain.checkpoint.CheckpointSave(iterator),
          pos=mtc.ProcessJsonSave(_position(step, me))))
      if step == args.ready_at:
        emit(f"READY process={me} step={step}")
      if step == args.hold_at:
        mgr.wait_until_finished()
        emit(f"CHECKPOINTED process={me} step={step}")
        threading.Event().wait()  # until the test kills the job: step --hold-at is the last
      step += 1
    mgr.wait_until_finished()
    common.committed(args, mgr)
  return 0


def cmd_plain_iterate(args) -> int:
  """Restore --step from the persistent tier with a plain `ocp.CheckpointManager` and Grain's
  own args; print RESUMED with the next batch."""
  import grain
  import jax
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc import distributed

  distributed.initialize()
  mesh = common.make_mesh()
  me, count = jax.process_index(), jax.process_count()
  iterator = iter(data_loader(me, count))
  with ocp.CheckpointManager(args.persistent_dir) as mgr:
    restored = mgr.restore(args.step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(common.abstract_state(mesh, args.rows)),
        iter=grain.checkpoint.CheckpointRestore(iterator), pos=mtc.ProcessJsonRestore()))
  problems = common.compare_state(restored.state,
                                  common.make_state(mesh, args.rows, args.seed, args.step))
  if restored.pos != _position(args.step, me):
    problems.append(f"pos {restored.pos} != {_position(args.step, me)}")
  emit(f"RESUMED process={me} step={args.step} tier=plain ok={int(not problems)} "
       f"detail={'; '.join(problems)[:1500] or '-'}")
  emit(f"NEXT process={me} step={args.step + 1} values={_csv(next(restored.iter))}")
  return 0 if not problems else common.EXIT_MISMATCH


if __name__ == "__main__":
  sys.exit("run as: python tests/mp_worker iterate ...")
