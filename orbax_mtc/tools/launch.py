"""Run N local processes as the N hosts of one `jax.distributed` job.

Each child gets the `orbax_mtc.distributed` environment contract (coordinator on a free loopback
port, process id, process count, its own RAM-disk folder `<local_root>/node<i>`, worker index 0)
and, with `devices_per_process=K`, K CPU devices. The RAM-disk folders are created and never
deleted here: the RAM tier must survive a restart of the job.

Failure handling mirrors a cluster scheduler: the job fails as soon as one process fails, and
then every other process is killed. Children are killed with SIGKILL on their whole process
group, because after `jax.distributed.initialize` JAX's preemption notifier catches SIGTERM and
a child would keep running. Exit codes follow the shell: a death by signal N reads 128+N.

`run_processes(..., forward_sigterm=True)` (what `orbax-mtc launch` uses) turns a SIGTERM sent
to the launcher into a SIGTERM to every child, which is what a Cloud TPU maintenance event does
to every host; the children then have `sigterm_grace_s` to save and exit before being killed.

Children join the job with `orbax_mtc.distributed.initialize()`, which also makes them leave it
together: at exit every process waits for the collectives still in flight before JAX shuts
`jax.distributed` down (otherwise one of them can hang in that shutdown for good). A program
that calls `jax.distributed.initialize` itself should call
`orbax_mtc.distributed.finish_collectives()` on every process before it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from absl import logging

from orbax_mtc import distributed
from orbax_mtc.tools.launch_os import SecondSigterm, free_port, killpg, shell_code, signals_blocked

__all__ = ["Job", "LaunchResult", "main", "merge_xla_flags", "run_processes"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_POLL_INTERVAL_S = 0.05
# How long to wait for a reader thread to drain a pipe after its process group is gone. Only a
# grandchild that left the group (setsid) can hold the pipe open longer; we do not wait for it.
_READER_JOIN_S = 5.0
TIMEOUT_RETURNCODE = 124  # as timeout(1)


@dataclasses.dataclass
class LaunchResult:
  """Outcome of a launch.

  Attributes:
    returncode: 0 when every process exited 0; else the failed process's code (128+N for a
      death by signal N), 124 on timeout, 128+SIGTERM when the launcher was terminated and
      the children did not exit within the grace period.
    returncodes: each process's code in the same convention (those we killed read 137);
      None only for a process that never started.
    failed_process: index of the first process seen failing, None on success or timeout.
    pids: process ids of the children, in node order.
    timed_out: whether `timeout_s` ran out.
  """

  returncode: int
  returncodes: list[int | None]
  failed_process: int | None
  pids: list[int] = dataclasses.field(default_factory=list)
  timed_out: bool = False


def merge_xla_flags(xla_flags: str | None, device_count: int) -> str:
  """`xla_flags` with the host device count set to `device_count`, other flags kept."""
  kept = [
      flag for flag in shlex.split(xla_flags or "")
      if flag.split("=", 1)[0] != _DEVICE_COUNT_FLAG
  ]
  kept.append(f"{_DEVICE_COUNT_FLAG}={device_count}")
  return shlex.join(kept)




class Job:
  """N child processes forming one `jax.distributed` job; see `run_processes`.

  Usable as a context manager: leaving the block kills and reaps whatever still runs.
  """

  def __init__(
      self,
      command: Sequence[str],
      nprocs: int,
      *,
      devices_per_process: int | None = None,
      local_root: str | os.PathLike[str] = "/dev/shm/orbax-mtc",
      env: Mapping[str, str] | None = None,
      prefix_output: bool = True,
      output: IO[str] | None = None,
  ):
    if isinstance(command, str):
      raise TypeError("command must be a sequence of arguments, not a string.")
    if not command:
      raise ValueError("command is empty.")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
      raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}.")
    if devices_per_process is not None and (
        isinstance(devices_per_process, bool)
        or not isinstance(devices_per_process, int)
        or devices_per_process < 1
    ):
      raise ValueError(
          f"devices_per_process must be a positive integer or None, got {devices_per_process!r}."
      )
    self.command = [os.fspath(arg) for arg in command]
    self.nprocs = nprocs
    self.devices_per_process = devices_per_process
    self.local_root = pathlib.Path(local_root).absolute()
    self.env = dict(env or {})
    self.prefix_output = prefix_output
    self.output = output
    self.coordinator: str | None = None
    self.procs: list[subprocess.Popen[bytes]] = []
    self.returncodes: list[int | None] = [None] * nprocs
    self.failed_process: int | None = None
    self._readers: list[threading.Thread] = []
    self._output_lock = threading.Lock()

  # -- start ---------------------------------------------------------------------------------

  def local_directory(self, process_id: int) -> pathlib.Path:
    """The RAM-disk folder of process `process_id`."""
    return self.local_root / f"node{process_id}"

  def child_env(self, process_id: int) -> dict[str, str]:
    """The environment process `process_id` is started with."""
    assert self.coordinator is not None, "start() first"
    env = {**os.environ, **self.env}
    env.update({
        distributed.ORBAX_MTC_COORDINATOR: self.coordinator,
        distributed.ORBAX_MTC_NUM_PROCESSES: str(self.nprocs),
        distributed.ORBAX_MTC_PROCESS_ID: str(process_id),
        distributed.ORBAX_MTC_LOCAL_DIR: str(self.local_directory(process_id)),
        # Each local process plays one whole host.
        distributed.ORBAX_MTC_WORKER_INDEX: "0",
        # JAX's coordinator binds all interfaces by default; a local job needs loopback only,
        # which is also where the free port was checked.
        "JAX_COORDINATOR_BIND_ADDRESS": self.coordinator,
    })
    # Children write to a pipe, where Python would buffer whole blocks; prefixed lines should
    # appear as they are printed.
    if self.prefix_output:
      env.setdefault("PYTHONUNBUFFERED", "1")
    if self.devices_per_process is not None:
      env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS"), self.devices_per_process)
      env.setdefault("JAX_PLATFORMS", "cpu")
    return env

  def start(self) -> Job:
    """Creates the node folders and starts every process; on any error kills those started."""
    if self.procs:
      raise RuntimeError("Job already started.")
    for i in range(self.nprocs):
      # Private, as the manager makes its own folders: each holds a node's model weights.
      self.local_directory(i).mkdir(mode=0o700, parents=True, exist_ok=True)
    self.coordinator = f"127.0.0.1:{free_port()}"
    logging.info(
        "Launching %d processes, coordinator %s, local root %s: %s",
        self.nprocs, self.coordinator, self.local_root, shlex.join(self.command),
    )
    try:
      for i in range(self.nprocs):
        proc = self._spawn(i)
        self.procs.append(proc)
        if self.prefix_output:
          reader = threading.Thread(
              target=self._relay, args=(i, proc.stdout), name=f"orbax-mtc-node{i}", daemon=True
          )
          reader.start()
          self._readers.append(reader)
    except BaseException:
      self.kill()
      raise
    return self

  def _spawn(self, process_id: int) -> subprocess.Popen[bytes]:
    """Starts process `process_id` (its output piped when prefixed)."""
    return subprocess.Popen(
        self.command,
        env=self.child_env(process_id),
        # N processes cannot share a terminal's stdin; and in a session of their own they
        # would be stopped (SIGTTIN) on reading it.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if self.prefix_output else None,
        stderr=subprocess.STDOUT if self.prefix_output else None,
        # Own session and process group: killpg reaches whatever the child spawns, and a
        # terminal Ctrl-C reaches only the launcher, which then kills the job as a whole.
        start_new_session=True,
    )

  def _relay(self, process_id: int, pipe: IO[bytes]) -> None:
    """Copies one child's output line by line, prefixed with its node index."""
    prefix = f"[node {process_id}] "
    out = self.output if self.output is not None else sys.stdout
    try:
      for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
          line += "\n"
        with self._output_lock:
          out.write(prefix + line)
          with contextlib.suppress(Exception):
            out.flush()
    except (OSError, ValueError) as e:  # pipe or output closed under us
      logging.debug("Output relay of node %d stopped: %s", process_id, e)
    finally:
      with contextlib.suppress(OSError):
        pipe.close()

  # -- wait ----------------------------------------------------------------------------------

  @property
  def pids(self) -> list[int]:
    return [proc.pid for proc in self.procs]

  def _exited_code(self, proc: subprocess.Popen[bytes]) -> int | None:
    """Exit code of `proc` if it has ended, leaving it unreaped (a zombie)."""
    if proc.returncode is not None:
      return proc.returncode
    if not hasattr(os, "waitid"):  # pragma: no cover - non-Linux fallback
      return proc.poll()
    try:
      # WNOWAIT: the zombie keeps its pid, which is also its group id, reserved, so the
      # killpg in _reap cannot hit an unrelated group that reused the number.
      info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped elsewhere
      return proc.poll()
    if info is None:
      return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

  def _reap(self, index: int, sig: int = signal.SIGKILL) -> int:
    """Kills process `index`'s group (stragglers included) and reaps it; returns shell code."""
    proc = self.procs[index]
    if proc.returncode is None:
      killpg(proc.pid, sig)
      proc.wait()
    code = shell_code(proc.returncode)
    self.returncodes[index] = code
    return code

  def poll(self) -> bool:
    """Reaps ended processes; returns True when the job is over (all exited 0, or one failed)."""
    for i, proc in enumerate(self.procs):
      if self.returncodes[i] is not None:
        continue
      code = self._exited_code(proc)
      if code is None:
        continue
      code = self._reap(i)
      if code != 0 and self.failed_process is None:
        self.failed_process = i
        logging.error(
            "Node %d (pid %d) exited with code %d; killing the other nodes.", i, proc.pid, code
        )
    return self.failed_process is not None or all(c is not None for c in self.returncodes)

  def terminate(self) -> None:
    """Sends SIGTERM to every running process group (a preemption notice, not a kill)."""
    for i, proc in enumerate(self.procs):
      if self.returncodes[i] is None and proc.returncode is None:
        killpg(proc.pid, signal.SIGTERM)

  def kill(self) -> None:
    """SIGKILLs every process group still running and reaps it; joins the output relays."""
    with signals_blocked():
      for i in range(len(self.procs)):
        if self.returncodes[i] is None:
          self._reap(i)
      for reader in self._readers:
        reader.join(timeout=_READER_JOIN_S)
        if reader.is_alive():
          logging.warning(
              "%s: output pipe still held open by a process outside its group.", reader.name
          )

  def __enter__(self) -> Job:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.kill()

  def wait(
      self,
      timeout_s: float | None = None,
      *,
      forward_sigterm: bool = False,
      sigterm_grace_s: float = 300.0,
  ) -> LaunchResult:
    """Waits for the job to end, kills what is left, and returns the result.

    On timeout, on a failed process, and on any exception (KeyboardInterrupt included) every
    process group is SIGKILLed and reaped before this returns or raises.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    terminated_at: list[float] = []  # set by the SIGTERM handler (main thread only)
    old_handler = None
    if forward_sigterm:
      if threading.current_thread() is threading.main_thread():
        def on_sigterm(signum: int, frame: object) -> None:
          del signum, frame
          if terminated_at:  # second SIGTERM: stop waiting for a graceful exit
            raise SecondSigterm
          terminated_at.append(time.monotonic())
          logging.warning("SIGTERM received: forwarding it to every node.")
          self.terminate()

        old_handler = signal.signal(signal.SIGTERM, on_sigterm)
      else:
        logging.warning("forward_sigterm needs the main thread; SIGTERM is not forwarded.")
    timed_out = terminated = False
    try:
      while not self.poll():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
          timed_out = True
          logging.error("Timed out after %.1f s; killing every node.", timeout_s)
          break
        if terminated_at and now >= terminated_at[0] + sigterm_grace_s:
          terminated = True
          logging.error(
              "Nodes still running %.0f s after SIGTERM; killing them.", sigterm_grace_s
          )
          break
        time.sleep(_POLL_INTERVAL_S)
    except SecondSigterm:
      terminated = True
      logging.error("Second SIGTERM received; killing every node.")
    finally:
      if old_handler is not None:
        signal.signal(signal.SIGTERM, old_handler)
      self.kill()
    if timed_out:
      returncode = TIMEOUT_RETURNCODE
    elif terminated:
      returncode = 128 + signal.SIGTERM
    elif self.failed_process is not None:
      returncode = self.returncodes[self.failed_process] or 1
    else:
      returncode = 0
    return LaunchResult(
        returncode=returncode,
        returncodes=list(self.returncodes),
        failed_process=self.failed_process,
        pids=self.pids,
        timed_out=timed_out,
    )


def run_processes(
    command: Sequence[str],
    nprocs: int,
    *,
    devices_per_process: int | None = None,
    local_root: str | os.PathLike[str] = "/dev/shm/orbax-mtc",
    env: Mapping[str, str] | None = None,
    prefix_output: bool = True,
    output: IO[str] | None = None,
    timeout_s: float | None = None,
    forward_sigterm: bool = False,
    sigterm_grace_s: float = 300.0,
) -> LaunchResult:
  """Runs `command` as `nprocs` processes of one `jax.distributed` job and waits for them.

  Args:
    command: program and arguments, run unchanged by every process.
    nprocs: number of processes (simulated hosts).
    devices_per_process: K CPU devices per process (`--xla_force_host_platform_device_count`,
      other XLA_FLAGS kept; JAX_PLATFORMS=cpu unless set). None leaves devices alone.
    local_root: parent of the per-process RAM-disk folders `node<i>` (created, never deleted).
    env: variables added to this process's environment for the children.
    prefix_output: relay each child's stdout+stderr line by line as `[node i] ...` to `output`
      (default: `sys.stdout` at call time); else children inherit stdout/stderr.
    output: text stream for prefixed output.
    timeout_s: kill the job after this many seconds; the result then has returncode 124.
    forward_sigterm: while waiting, relay a SIGTERM sent to this process to every child as a
      preemption notice (main thread only); kill them `sigterm_grace_s` later, or at once on a
      second SIGTERM.
    sigterm_grace_s: see `forward_sigterm`.

  Returns:
    The `LaunchResult`; its returncode is 0 only when every process exited 0.
  """
  job = Job(
      command, nprocs, devices_per_process=devices_per_process, local_root=local_root, env=env,
      prefix_output=prefix_output, output=output,
  )
  with job:
    job.start()
    return job.wait(timeout_s, forward_sigterm=forward_sigterm, sigterm_grace_s=sigterm_grace_s)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc launch",
      description="A single-host launcher for tests and demos: run a command as N local "
      "processes of one jax.distributed job, each with its own RAM-disk folder "
      "(ORBAX_MTC_LOCAL_DIR). Example: orbax-mtc launch --nprocs 2 --devices-per-process 4 "
      "-- python train.py. Real clusters (GKE JobSet, Slurm, TPU VMs) start the processes "
      "with their own launcher, and the program calls mtc.distributed.initialize() to join "
      "the job.",
  )
  parser.add_argument("--nprocs", type=int, required=True, help="number of processes")
  parser.add_argument(
      "--devices-per-process", type=int, default=None,
      help="CPU devices per process (sets XLA_FLAGS and JAX_PLATFORMS=cpu; default: the "
      "platform's own devices)",
  )
  parser.add_argument(
      "--local-root", default="/dev/shm/orbax-mtc",
      help="parent of the per-process folders node<i> (default: %(default)s)",
  )
  parser.add_argument(
      "--timeout", type=float, default=None,
      help="kill the job after this many seconds (default: no limit)"
  )
  parser.add_argument(
      "--sigterm-grace", type=float, default=300.0,
      help="seconds the processes get after a forwarded SIGTERM (default: %(default)s)",
  )
  parser.add_argument(
      "--no-prefix", action="store_true",
      help="let processes write to the terminal directly instead of prefixing '[node i] '",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """`orbax-mtc launch`: returns the job's exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  # Everything after the first "--" is the command, even if it looks like our own options.
  command: list[str] = []
  if "--" in argv:
    split = argv.index("--")
    argv, command = argv[:split], argv[split + 1:]
  args = parser.parse_args(argv)
  command = command or args.command
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    parser.error("no command given; usage: orbax-mtc launch --nprocs N -- python train.py")
  if args.nprocs < 1:
    parser.error(f"--nprocs must be >= 1, got {args.nprocs}")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error(f"--devices-per-process must be >= 1, got {args.devices_per_process}")
  try:
    result = run_processes(
        command,
        args.nprocs,
        devices_per_process=args.devices_per_process,
        local_root=args.local_root,
        prefix_output=not args.no_prefix,
        timeout_s=args.timeout,
        forward_sigterm=True,
        sigterm_grace_s=args.sigterm_grace,
    )
  except KeyboardInterrupt:
    logging.warning("Interrupted; every node was killed.")
    return 128 + signal.SIGINT
  except OSError as e:  # e.g. the program does not exist
    print(f"orbax-mtc launch: cannot start {command[0]!r}: {e}", file=sys.stderr)
    return 127
  return result.returncode
