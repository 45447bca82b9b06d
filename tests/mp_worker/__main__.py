"""Child program of the multi-process tests: one JAX process of a `jax.distributed` job.

Started by `orbax_mtc.tools.launch.Job` (which sets ORBAX_MTC_*;
`orbax_mtc.distributed.initialize()` joins the job), or alone for `plain-restore`, as
`python tests/mp_worker <sub-command>`. Every state is a pure function of (seed, step, mesh
shape) (`orbax_mtc.testing.sharded_state`), so a process that restores step S recomputes what
was saved at S and compares it bit for bit, on its own shards only. Output is one
machine-readable line per event (format: `events`).

Sub-commands:
  save           save steps [--start, --steps) (optionally restore first and resume), then close.
  restore        restore(None) and compare; --expect-step/--expect-tier make a mismatch an error.
  chaos          restore (if anything) and compare, then save every step until killed.
  resave, steps, open, force-old, mirror
                 forced saves, step listing and explicit restores, opening only, a forced older
                 step, the parent-style form with a RAM tier (`save_restore`).
  plain-restore  one process, no jax.distributed: read the persistent tier with a plain
                 `ocp.CheckpointManager` (numpy and single-device targets) and compare.
  iterate, plain-iterate
                 training on real Grain data: the data iterator's position and a per-process
                 JSON item saved beside the state, restored with it (`iterators`); the
                 persistent step read back by a plain `ocp.CheckpointManager`.
  transport, chunk-race, managed-init, reduce, parent-resume
                 the chunked streams between processes, chunks left moving beside a
                 training step, the GKE-style start, the save agreement's reductions
                 through the real all-reduce, the parent-style form's resume (`plain`).
  fault, mismatch, outage
                 one injected fault, a restore target of another layout, a GCS outage
                 (`faults`).
  restore-exit, items, restore-transient, pos
                 the restore-seam tests: exit the instant restore() returns, two items
                 restored in part, a transient error while building, a per-process JSON
                 item restored by restore(None) or restore(latest_step()) (`seams`).
  delete, clock, policies
                 delete() of a persistent step one process's view lacks; backups by minutes
                 where one process reads the last backup's time an hour earlier; every Orbax
                 save policy on either tier (`contained`, `policies`).
  preempt        restore (if anything) and compare, then train and save every --stride steps
                 until SIGTERM (sent by the test to any process) makes every process agree on
                 an on-demand step; then exit as the manager's options or flags say. Hooks
                 inject timing (a write or a restore that waits for the notice, an on-demand
                 write that waits for a go file); see `preempt.cmd_preempt` and `hooks`.

Exit codes: 0 ok, 3 wrong data / wrong step or tier, 4 bad usage, 5 no preemption within
--max-steps, 6 the on-demand save did not behave as asked (returned under
exit_after_ondemand_checkpoint, or a second sync point), 7 the manager raised (fault, open:
reported as RAISED).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

if not __package__:  # run as `python tests/mp_worker`: import the package from tests/
  _here = pathlib.Path(__file__).resolve().parent
  sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _here]
  sys.path.insert(0, str(_here.parent))

from mp_worker import (  # noqa: E402
    common,
    contained,
    faults,
    iterators,
    plain,
    preempt,
    save_restore,
    seams,
)
from mp_worker.hooks import FAULT_PHASES  # noqa: E402


def _common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rows", type=int, default=8,
                 help="rows of params/w per process (256 bytes each)")
  p.add_argument("--persistent-dir", required=True)
  p.add_argument("--local-dir", default=None, help="default: ORBAX_MTC_LOCAL_DIR")
  p.add_argument("--local-interval", type=int, default=2)
  p.add_argument("--local-keep", type=int, default=2)
  p.add_argument("--persistent-interval", type=int, default=4)
  p.add_argument("--persistent-keep", type=int, default=None)
  p.add_argument("--backup-minutes", type=float, default=None,
                 help="back up by minutes instead of --persistent-interval steps")
  p.add_argument("--resume-latest", action="store_true",
                 help="restore mgr.latest_step() explicitly instead of restore(None)")
  p.add_argument("--explicit-args", action="store_true",
                 help="restore with Composite(state=PyTreeRestore(item=abstract))")
  p.add_argument("--cast-to", default=None,
                 help="restore the float32 leaves as this dtype (e.g. bfloat16), as Orbax casts")
  p.add_argument("--expect-step", default=None, help="a step number, or 'None'")
  p.add_argument("--expect-tier", default=None,
                 choices=("local", "peer", "persistent", "none", "replicator", "elastic"))
  p.add_argument("--mode", choices=("standalone", "managed"), default="standalone",
                 help="managed: GKE's replicator protocol (tests run a simulator)")
  p.add_argument("--managed-peers-per-node", type=int, default=None)
  p.add_argument("--managed-timeout", type=float, default=60.0)
  p.add_argument("--job-name", default="orbax")
  p.add_argument("--set-mesh", action="store_true",
                 help="jax.set_mesh(the job's mesh), globally, before the manager is built")
  p.add_argument("--replicas", type=int, default=None,
                 help="size of the mesh's data axis (default: one row per process)")
  p.add_argument("--layout", choices=("mixed", "dp"), default="mixed",
                 help="dp: every leaf replicated across the data axis")
  p.add_argument("--shape-axes", default=None,
                 help="D,M: the state's shapes follow a (data=D, model=M) mesh whatever the "
                      "job's mesh (restore on another mesh or process count)")
  p.add_argument("--keys", action="store_true",
                 help="typed PRNG key leaves in the state too (rngs/...)")
  p.add_argument("--peers-per-node", type=int, default=None)
  p.add_argument("--chunk-mib", type=int, default=None,
                 help="ReplicationOptions.chunk_mib (default: the library's)")
  p.add_argument("--max-spread", type=int, default=1,
                 help="ReplicationOptions.max_spread_intervals; 1 here (each step's copies "
                      "out before the next local save) keeps which steps have copies exact")
  p.add_argument("--stretch", type=int, default=None,
                 help="spread every step's copies over this many local intervals, as on a "
                      "link that lags them (hooks.fixed_stretch)")
  p.add_argument("--call-mib", type=int, default=None,
                 help="MiB of copies a save() call moves before the interval is known "
                      "(hooks.small_replication_calls)")
  p.add_argument("--report-copies", action="store_true",
                 help="a HELD line after each save: the peer copies this node holds")
  p.add_argument("--no-land-backups", dest="land_backups", action="store_false",
                 help="do not wait for each scheduled backup to land")
  p.add_argument("--backup-timeout", type=int, default=None,
                 help="AsyncOptions.timeout_secs of the persistent tier")
  p.add_argument("--agreement-timeout", type=float, default=None,
                 help="CheckpointManagerOptions.agreement_timeout_seconds")
  return p


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  # Sub-commands whose save loop never dies on purpose (no --die-at-step).
  no_dying = {"die_at_step": None, "die_process": None}

  p = _common(sub.add_parser("save"))
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--steps", type=int, required=True, help="save steps [start, steps)")
  p.add_argument("--restore-first", action="store_true")
  p.add_argument("--restore-after", action="store_true",
                 help="restore(None) once the saves are done (an AGAIN line)")
  p.add_argument("--die-at-step", type=int, default=None)
  p.add_argument("--die-process", type=int, default=1)
  p.add_argument("--count-rounds", action="store_true",
                 help="a ROUND line per agreement round (hooks.count_rounds)")
  p.set_defaults(fn=save_restore.cmd_save)

  p = _common(sub.add_parser("restore"))
  p.set_defaults(fn=save_restore.cmd_restore)

  p = _common(sub.add_parser("managed-init"))
  p.add_argument("--steps", type=int, required=True, help="save steps up to this one")
  p.set_defaults(fn=plain.cmd_managed_init, **no_dying)

  p = _common(sub.add_parser("parent-resume"))
  p.add_argument("--steps", type=int, required=True, help="save steps up to this one")
  p.add_argument("--phase", choices=FAULT_PHASES, default=None, help="as fault's")
  p.add_argument("--start", type=int, default=0,
                 help="the first step saved when there is nothing to restore")
  p.add_argument("--die-after", type=int, default=None,
                 help="every process SIGKILLs itself once this step is committed in its RAM "
                 "folder and the persistent folder, before the next save")
  p.add_argument("--fault-process", type=int, default=1)
  p.add_argument("--fault-step", type=int, default=None)
  p.set_defaults(fn=plain.cmd_parent_resume, **no_dying)

  p = _common(sub.add_parser("steps"))
  p.add_argument("--restore-steps", default="latest",
                 help="comma-separated steps to restore in turn; 'latest': mgr.latest_step()")
  p.set_defaults(fn=save_restore.cmd_steps)

  p = _common(sub.add_parser("mismatch"))
  p.set_defaults(fn=faults.cmd_mismatch)

  p = _common(sub.add_parser("fault"))
  p.add_argument("--phase", choices=FAULT_PHASES, required=True)
  p.add_argument("--fault-process", type=int, default=1)
  p.add_argument("--fault-step", type=int, default=None)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--restore-first", action="store_true")
  p.add_argument("--no-step-collective", action="store_true",
                 help="no global reduction per step: the manager's agreements are the only "
                 "collectives (a dead process is then noticed there, not in a training step)")
  p.set_defaults(fn=faults.cmd_fault, **no_dying)

  p = _common(sub.add_parser("force-old"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--old-step", type=int, required=True)
  p.set_defaults(fn=save_restore.cmd_force_old, **no_dying)

  p = _common(sub.add_parser("mirror"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--restore-first", action="store_true")
  p.set_defaults(fn=save_restore.cmd_mirror)

  p = _common(sub.add_parser("open"))
  p.set_defaults(fn=save_restore.cmd_open)

  p = _common(sub.add_parser("chaos"))
  p.add_argument("--steps", type=int, default=10_000, help="steps to save after the restore")
  p.set_defaults(fn=save_restore.cmd_chaos, **no_dying)

  p = sub.add_parser("plain-restore")
  p.add_argument("--persistent-dir", required=True)
  p.add_argument("--step", type=int, required=True)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--data", type=int, required=True, help="data axis size when saved")
  p.add_argument("--model", type=int, required=True, help="model axis size when saved")
  p.set_defaults(fn=plain.cmd_plain_restore)

  p = _common(sub.add_parser("resave"))
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--drop-process", type=int, default=1)
  p.set_defaults(fn=save_restore.cmd_resave, **no_dying)

  p = _common(sub.add_parser("delete"))
  p.add_argument("--step", type=int, required=True)
  p.add_argument("--lag-process", type=int, default=1)
  p.set_defaults(fn=contained.cmd_delete)

  p = _common(sub.add_parser("train-die"))
  p.add_argument("--steps", type=int, default=10_000)
  p.add_argument("--die-at-step", type=int, default=5)
  p.add_argument("--die-process", type=int, default=1)
  p.set_defaults(fn=contained.cmd_train_die)

  p = _common(sub.add_parser("policies"))
  p.add_argument("--tier", choices=["ram", "persistent"], required=True)
  p.set_defaults(fn=contained.cmd_policies)

  p = _common(sub.add_parser("empty-restore"))
  p.add_argument("--fail-process", type=int, default=-1)
  p.set_defaults(fn=contained.cmd_empty_restore)

  p = _common(sub.add_parser("clock"))
  p.add_argument("--step", type=int, required=True)
  p.add_argument("--lag-process", type=int, default=1)
  p.set_defaults(fn=contained.cmd_clock)

  p = sub.add_parser("transport")
  p.add_argument("--chunk-bytes", type=int, default=16384)
  p.add_argument("--stepwise-calls", type=int, default=6,
                 help="calls that issue one chunk each before the rest is run at once")
  p.add_argument("--fault", choices=["none", "read", "place", "sink"], default="none",
                 help="on process 1, from its third chunk on: the reader, the placement or "
                 "the sink fails")
  p.set_defaults(fn=plain.cmd_transport)

  p = sub.add_parser("chunk-race")
  p.add_argument("--chunk-bytes", type=int, default=16384)
  p.add_argument("--rounds", type=int, default=400)
  p.set_defaults(fn=plain.cmd_chunk_race)

  p = sub.add_parser("reduce")
  p.set_defaults(fn=plain.cmd_reduce)

  p = _common(sub.add_parser("outage"))
  p.add_argument("--control", required=True, help="file holding the phase the test sets")
  p.add_argument("--max-steps", type=int, default=20_000)
  p.set_defaults(fn=faults.cmd_outage)

  p = _common(sub.add_parser("iterate"))
  p.add_argument("--steps", type=int, required=True, help="train steps up to this one")
  p.add_argument("--hold-at", type=int, default=None,
                 help="after saving this step, wait until it is committed; CHECKPOINTED")
  p.add_argument("--ready-at", type=int, default=None, help="print READY after this step")
  p.add_argument("--preempt", action="store_true",
                 help="exit_after_ondemand_checkpoint=True, reached_preemption each step")
  p.set_defaults(fn=iterators.cmd_iterate)

  p = _common(sub.add_parser("plain-iterate"))
  p.add_argument("--step", type=int, required=True)
  p.set_defaults(fn=iterators.cmd_plain_iterate)

  p = _common(sub.add_parser("preempt"))
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
  p.add_argument("--first-step", type=int, default=0, help="the first step without a restore")
  p.add_argument("--dataset-dir", default=None,
                 help="persistent_non_replicated_directory; each save adds a `dataset` item")
  p.set_defaults(fn=preempt.cmd_preempt)

  # The restore-seam tests (`seams`).
  p = _common(sub.add_parser("restore-exit"))
  p.set_defaults(fn=seams.cmd_restore_exit)

  p = _common(sub.add_parser("restore-die"))
  p.add_argument("--die-process", type=int, default=1)
  p.set_defaults(fn=seams.cmd_restore_die)

  p = _common(sub.add_parser("items"))
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--steps", type=int, default=0, help="save steps [start, steps)")
  p.add_argument("--restore-items", default="",
                 help="comma-separated items (params, opt) to restore(None) first")
  p.set_defaults(fn=seams.cmd_items)

  p = _common(sub.add_parser("restore-transient"))
  p.add_argument("--fault-process", type=int, default=1)
  p.set_defaults(fn=seams.cmd_restore_transient)

  p = _common(sub.add_parser("pos"))
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--steps", type=int, default=0, help="save steps [start, steps)")
  p.add_argument("--restore", choices=("none", "state", "none-pos", "latest-pos"),
                 default="none")
  p.set_defaults(fn=seams.cmd_pos)
  return parser


def main(argv: list[str] | None = None) -> int:
  import faulthandler
  import logging
  import os

  stacks_after = os.environ.get("MTC_TEST_STACKS_AFTER_S")
  if stacks_after:  # mp_helpers.STACKS_AFTER_S: where a job about to be killed waits
    faulthandler.dump_traceback_later(float(stacks_after), exit=False)
    common.report_progress_at(float(stacks_after) - 4, float(stacks_after) - 1)

  # Without Google credentials (the loopback GCS server) gcsfs warns on every bucket access.
  logging.getLogger("gcsfs").setLevel(logging.ERROR)
  args = _parser().parse_args(argv)
  common.configure(args)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
