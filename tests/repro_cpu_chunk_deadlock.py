"""Campaign for the CPU deadlock between a moving peer chunk and the next training step.

Not collected by pytest (minutes a campaign; the chunk-race test in test_transport.py pins
the fix in seconds): see docs/design.md, "Nothing waits forever". Each run is a fresh
2-process job (2 CPU devices each) of `mp_worker preempt` with no SIGTERM: a training step
(an all-reduce) and a save every step, RAM every 2 steps with peer copies, for --steps
steps. A run that has not ended within --timeout-s is a hang; with --gdb DIR the native
stacks of both processes go there first. Before node_mesh.py, 4 of 30 and 5 of 25 runs
hung (an all-reduce on both devices of one process, a CollectivePermute and an all-reduce
on the other); 0 of 30 since.

  python tests/repro_cpu_chunk_deadlock.py --runs 30 --steps 200 [--no-peers] [--gdb DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from mp_helpers import new_root, started_job


def run_once(steps: int, peers: bool, timeout_s: float, gdb: pathlib.Path | None) -> bool:
  """One job; True if it hung."""
  root = new_root("deadlock")
  root.mkdir(parents=True)
  with tempfile.TemporaryDirectory() as tmp:
    command = ["preempt", "--persistent-dir", f"{tmp}/persistent", "--local-interval", "2",
               "--persistent-interval", "1000", "--self-exit", "--max-steps", str(steps),
               *([] if peers else ["--peers-per-node", "0"])]
    try:
      with started_job(command, 2, root) as (job, _):
        deadline = time.monotonic() + timeout_s
        while not job.poll() and time.monotonic() < deadline:
          time.sleep(0.2)  # polling a child's exit, not synchronising with it
        hung = not job.poll()
        if hung and gdb is not None:
          gdb.mkdir(parents=True, exist_ok=True)
          for node, pid in enumerate(job.pids):
            stacks = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex",
                                     "thread apply all bt"], capture_output=True, text=True,
                                    timeout=120).stdout
            (gdb / f"node{node}-{int(time.time())}.txt").write_text(stacks)
        job.wait(1)
    finally:
      shutil.rmtree(root, ignore_errors=True)
  return hung


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--timeout-s", type=float, default=60)
  parser.add_argument("--no-peers", action="store_true")
  parser.add_argument("--gdb", type=pathlib.Path, default=None)
  args = parser.parse_args()
  hangs = 0
  for run in range(args.runs):
    hung = run_once(args.steps, not args.no_peers, args.timeout_s, args.gdb)
    hangs += hung
    print(f"run {run}: {'HANG' if hung else 'ended'}", flush=True)
  print(f"{hangs} of {args.runs} runs hung")
  return 1 if hangs else 0


if __name__ == "__main__":
  sys.exit(main())
