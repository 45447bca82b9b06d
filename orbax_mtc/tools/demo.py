"""`orbax-mtc demo`: train, lose a process to SIGKILL, restart, resume from RAM, get a SIGTERM,
save on demand, restart again from that step, summarise.

Embedded defaults: RAM tier under /dev/shm/orbax-mtc-demo/local/node<i>, persistent tier in
/tmp/orbax-mtc-demo/persistent, 4 processes of one CPU device each on a 2x2 (data, model) mesh.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from orbax_mtc.tools import launch


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="orbax-mtc demo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--nprocs", type=int, default=4,
                 help="processes of the job, one CPU device each; even, for the mesh's data "
                 "axis of 2 (default: %(default)s)")
  p.add_argument("--steps", type=int, default=80,
                 help="the last training step: each restarted run resumes and trains on to it "
                 "(default: %(default)s)")
  p.add_argument("--local-every", type=int, default=5,
                 help="save to the RAM tier every this many steps (default: %(default)s)")
  p.add_argument("--persistent-every", type=int, default=25,
                 help="save to the persistent tier every this many steps (default: %(default)s)")
  p.add_argument("--kill-at-step", type=int, default=38,
                 help="the first run loses a process to SIGKILL at this step "
                 "(default: %(default)s)")
  p.add_argument("--kill-rank", type=int, default=None,
                 help="the process that is SIGKILLed (default: the last one)")
  p.add_argument("--sigterm-at-step", type=int, default=50,
                 help="after the restart, process 0 gets SIGTERM at this step "
                 "(default: %(default)s)")
  p.add_argument("--local-root", default="/dev/shm/orbax-mtc-demo",
                 help="RAM-disk folder for the nodes' local tiers and the reports "
                 "(default: %(default)s)")
  p.add_argument("--persistent-dir", default="/tmp/orbax-mtc-demo/persistent",
                 help="the persistent tier (default: %(default)s)")
  p.add_argument("--keep", action="store_true",
                 help="keep both tiers' folders afterwards (default: remove them)")
  p.add_argument("--timeout", type=float, default=300.0,
                 help="seconds each of the three runs may take before every process is killed "
                 "(default: %(default)s)")
  return p


def _reports(report_dir: Path, phase: int) -> list[dict]:
  return [json.loads(p.read_text()) for p in sorted(report_dir.glob(f"phase{phase}-node*.json"))]


def _mib(n: float) -> str:
  return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.nprocs % 2:
    raise SystemExit("--nprocs must be even: the demo mesh has a data axis of 2.")
  kill_rank = args.nprocs - 1 if args.kill_rank is None else args.kill_rank
  local_root = Path(args.local_root)
  persistent = Path(args.persistent_dir)
  report_dir = local_root / "reports"
  for path in (local_root, persistent):
    shutil.rmtree(path, ignore_errors=True)
  persistent.mkdir(parents=True, exist_ok=True)
  train = [sys.executable, "-m", "orbax_mtc.tools.demo_train", "--persistent-dir", str(persistent),
           "--report-dir", str(report_dir), "--steps", str(args.steps),
           "--local-every", str(args.local_every),
           "--persistent-every", str(args.persistent_every)]
  env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
  started = time.perf_counter()
  try:
    print(f"== phase 1: {args.nprocs} processes train; process {kill_rank} is SIGKILLed at "
          f"step {args.kill_at_step}", flush=True)
    first = launch.run_processes(
        train + ["--phase", "1", "--kill-rank", str(kill_rank),
                 "--kill-at-step", str(args.kill_at_step)],
        args.nprocs, devices_per_process=1, local_root=local_root / "local", env=env,
        timeout_s=args.timeout)
    if first.returncode == 0:
      print("demo: phase 1 was expected to lose a process but exited 0", file=sys.stderr)
      return 1
    print(f"== job failed as planned (exit {first.returncode}); restarting it", flush=True)
    second = launch.run_processes(
        train + ["--phase", "2", "--sigterm-rank", "0",
                 "--sigterm-at-step", str(args.sigterm_at_step)],
        args.nprocs, devices_per_process=1,
        local_root=local_root / "local", env=env, timeout_s=args.timeout)
    if second.returncode != 0:
      print(f"demo: the restarted job failed (exit {second.returncode})", file=sys.stderr)
      return second.returncode
    print(f"== phase 2 stopped after its on-demand checkpoint (SIGTERM at step "
          f"{args.sigterm_at_step}); restarting it", flush=True)
    third = launch.run_processes(
        train + ["--phase", "3"], args.nprocs, devices_per_process=1,
        local_root=local_root / "local", env=env, timeout_s=args.timeout)
    if third.returncode != 0:
      print(f"demo: the job restarted after SIGTERM failed (exit {third.returncode})",
            file=sys.stderr)
      return third.returncode
    phase1, phase2, phase3 = (_reports(report_dir, p) for p in (1, 2, 3))
    if len(phase2) != args.nprocs or len(phase3) != args.nprocs:
      print("demo: missing reports from the restarted jobs", file=sys.stderr)
      return 1
    ondemand_steps = {r.get("ondemand", {}).get("step") for r in phase2}
    after_sigterm = {(r["restore"]["tier"], r["restore"]["step"]) for r in phase3}
    if len(ondemand_steps) != 1 or None in ondemand_steps or \
        after_sigterm != {("local", next(iter(ondemand_steps)))}:
      print(f"demo: on-demand steps {ondemand_steps}, restored after SIGTERM {after_sigterm}",
            file=sys.stderr)
      return 1
    ondemand_step = ondemand_steps.pop()
    sent_at = next(r["sigterm_sent_at"] for r in phase2 if "sigterm_sent_at" in r)
    durable_s = max(r["ondemand_durable_at"] for r in phase2) - sent_at
    killed = next((r for r in phase1 if r["process"] == kill_rank), None)
    last_before = killed["last_step"] if killed else args.kill_at_step
    restores = {(r["restore"]["tier"], r["restore"]["step"]) for r in phase2}
    if len(restores) != 1:
      print(f"demo: processes disagree on the restored step: {restores}", file=sys.stderr)
      return 1
    tier, step = restores.pop()
    blocking = [b for r in phase1 + phase2 + phase3 for b in r["blocking_s"]]
    restore_s = max(r["restore"]["seconds"] for r in phase2)
    local_bytes = sum(r["local_bytes"] for r in phase2)
    persistent_bytes = max(r["persistent_bytes"] for r in phase2)
    rows = [
        ("processes x devices", f"{args.nprocs} x 1 (mesh data=2, model={args.nprocs // 2})"),
        ("failure", f"SIGKILL of process {kill_rank} at step {last_before}"),
        ("restored from", f"{tier} tier, step {step}"),
        ("steps lost", str(last_before - step)),
        ("restore time", f"{restore_s:.3f} s"),
        ("preemption", f"SIGTERM to process 0 at step {args.sigterm_at_step}: every process "
                       f"saved step {ondemand_step} on demand"),
        ("SIGTERM -> durable", f"{durable_s:.2f} s ({100 * durable_s / 300:.1f} % of 5 min)"),
        ("restored after it", f"local tier, step {ondemand_step}"),
        ("save blocking (median)", f"{statistics.median(blocking) * 1e3:.2f} ms"
         if blocking else "n/a"),
        ("RAM tier bytes (all nodes)", _mib(local_bytes)),
        ("persistent tier bytes", _mib(persistent_bytes)),
        ("final step / loss", f"{phase3[0]['last_step']} / {phase3[0]['final_loss']:.5f}"),
        ("wall time", f"{time.perf_counter() - started:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\norbax-mtc demo summary")
    for key, value in rows:
      print(f"  {key:<{width}}  {value}")
    if tier != "local":
      print("demo: expected a restore from RAM", file=sys.stderr)
      return 1
    return 0
  finally:
    if not args.keep:
      shutil.rmtree(local_root, ignore_errors=True)
      shutil.rmtree(persistent.parent if persistent.name == "persistent" else persistent,
                    ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
