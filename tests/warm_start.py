"""Forked starts for the tests' JAX and MaxText processes.

Each `python tests/mp_worker ...` process spends about 1.7 s of CPU importing JAX, Orbax and
orbax_mtc before it does anything (a MaxText run about 10 s), which on a 2-core machine is
most of a small job's time. `WarmJob` (for `launch.Job`) and `spawn` (for one process) start
such processes as forks of a server process (one per Python and module list, per test
session) that has imported those modules already and has not created any JAX backend: each
fork is still a separate OS process in a session of its own, which joins `jax.distributed`
itself, gets its own environment (XLA_FLAGS' device count is read when the fork creates its
backend), arguments, import path, output pipe, real signals and a real exit status. A
command of another form, a job whose import-time settings (JAX_*, PYTHONPATH, ...) differ
from the server's, and every command when MTC_TEST_COLD_START=1 are exec'd as before.

Protocol (a SOCK_SEQPACKET socket pair, one JSON message per packet):
  test -> server  {"op": "spawn", "argv", "env", "cwd"} with the output pipe's fd attached;
                  {"op": "reap", "pid"} once the test has seen the exit and killed the group.
  server -> test  {"op": "ready", "threads"} once its imports are done (a fork lacks every
                  thread but the one forking: with more, the test side execs instead);
                  {"op": "spawned", "pid"}; {"op": "exited", "pid", "code"} once per child,
                  the child left unreaped (its pid, also its group id, stays reserved until
                  the test asks, as `launch.Job` keeps its own children); {"op": "reaped",
                  "pid"} once it is.
A server whose socket closes SIGKILLs the groups of its children still running and exits.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading

HERE = pathlib.Path(__file__).resolve().parent
_MAX_PACKET = 1 << 20
_SPAWN_TIMEOUT_S = 60
_READY_TIMEOUT_S = 300  # a MaxText server imports for 10 s on a quiet 2-core VM


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
  data = json.dumps(message).encode()
  if fds:
    socket.send_fds(sock, [data], list(fds))
  else:
    sock.send(data)


# -- the server (a child of the test process) -------------------------------------------------


def _exit_code(pid: int) -> int | None:
  """`pid`'s exit code in Popen's convention if it has ended, leaving it unreaped."""
  info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  if info is None:
    return None
  return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _serve(sock: socket.socket) -> tuple[dict, int] | None:
  """Answers requests until the socket closes (returns None) or, in a fork, returns the
  spawn request and its output fd."""
  import selectors

  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_r, False)
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through wake_w
  selector = selectors.DefaultSelector()
  selector.register(sock, selectors.EVENT_READ)
  selector.register(wake_r, selectors.EVENT_READ)
  running: set[int] = set()  # forked, exit not reported yet
  ended: set[int] = set()  # exit reported, not reaped yet
  while True:
    for key, _ in selector.select():
      if key.fileobj == wake_r:
        while True:
          try:
            if not os.read(wake_r, 4096):
              break
          except BlockingIOError:
            break
        continue
      data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 1)
      if not data:
        for pid in running | ended:
          try:
            os.killpg(pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
        return None
      request = json.loads(data)
      if request["op"] == "reap":
        os.waitpid(request["pid"], 0)
        ended.discard(request["pid"])
        _send(sock, {"op": "reaped", "pid": request["pid"]})
        continue
      sys.stdout.flush()  # what the imports printed is the server's, not the forks'
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        for fd in (wake_r, wake_w):
          os.close(fd)
        sock.close()
        return request, fds[0]
      os.close(fds[0])
      running.add(pid)
      _send(sock, {"op": "spawned", "pid": pid})
    for pid in sorted(running):
      code = _exit_code(pid)
      if code is not None:
        running.discard(pid)
        ended.add(pid)
        _send(sock, {"op": "exited", "pid": pid, "code": code})


def _become(request: dict, out_fd: int) -> None:
  """In the fork: the process `python argv...` would have been, up to its imports."""
  os.setsid()
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  os.dup2(out_fd, 1)
  os.dup2(out_fd, 2)
  os.close(out_fd)
  os.environ.clear()
  os.environ.update(request["env"])
  os.chdir(request["cwd"])
  import runpy

  # sys.path[0] (the server's own folder) becomes what `python argv...` would put there.
  if request["argv"][1] == "-m":
    sys.argv = [request["argv"][2], *request["argv"][3:]]
    sys.path[0] = os.getcwd()
    runpy.run_module(request["argv"][2], run_name="__main__", alter_sys=True)
  else:
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else script
    runpy.run_path(script, run_name="__main__")


def _server_main(fd: int, preload: list[str]) -> None:
  # Imported once here, before any fork (with this folder first on the import path, as for
  # any script, until a fork puts its own there); none creates a JAX backend.
  import importlib

  for module in preload:
    importlib.import_module(module)
  with socket.socket(fileno=fd) as sock:
    # A thread running now would be missing in every fork: the test side then execs instead.
    _send(sock, {"op": "ready", "threads": len(os.listdir("/proc/self/task"))})
    spawned = _serve(sock)
  if spawned is not None:
    _become(*spawned)  # its SystemExit or exception ends the fork as it would end python


# -- the test side --------------------------------------------------------------------------


class ForkedProcess:
  """What `launch.Job` uses of a `subprocess.Popen`, for a process the server forked."""

  def __init__(self, starter: _Starter, pid: int, stdout):
    self._starter = starter
    self.pid = pid
    self.stdout = stdout
    self.returncode: int | None = None

  def exited_code(self) -> int | None:
    """The exit code once the process ended, before it is reaped (its pid stays reserved)."""
    return self.returncode if self.returncode is not None else self._starter.code(self.pid)

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      self._starter.wait_for(self.pid, timeout)
      self.returncode = self._starter.reap(self.pid)
    return self.returncode

  def poll(self) -> int | None:
    if self.returncode is None and self._starter.code(self.pid) is not None:
      return self.wait()
    return self.returncode


class _Starter:
  """The server process and the test side of its socket."""

  def __init__(self, python: str, preload: tuple[str, ...], env: dict[str, str]):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._log = tempfile.NamedTemporaryFile(prefix="orbax-mtc-warm-start-", suffix=".log",
                                            delete=False)
    self._server = subprocess.Popen(
        [python, str(pathlib.Path(__file__).resolve()), "serve", str(theirs.fileno()),
         ",".join(preload)],
        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=self._log,
        stderr=self._log)
    theirs.close()
    self._sock = ours
    self.import_env = _import_env(env)
    self._lock = threading.Lock()  # one spawn at a time: its answer is the next "spawned"
    self._spawned: queue.Queue[int] = queue.Queue()
    self._codes: dict[int, int] = {}
    self._reaped: set[int] = set()
    self._changed = threading.Condition()
    self._closed = False
    self._ready = threading.Event()
    self.threads = 0
    threading.Thread(target=self._read, name="warm-start", daemon=True).start()

  def _read(self) -> None:
    while True:
      try:
        data = self._sock.recv(_MAX_PACKET)
      except OSError:
        data = b""
      if not data:
        with self._changed:
          self._closed = True
          self._changed.notify_all()
        self._spawned.put(-1)
        self._ready.set()
        return
      message = json.loads(data)
      if message["op"] == "ready":
        self.threads = message["threads"]
        self._ready.set()
      elif message["op"] == "spawned":
        self._spawned.put(message["pid"])
      elif message["op"] == "reaped":
        with self._changed:
          self._reaped.add(message["pid"])
          self._changed.notify_all()
      else:
        with self._changed:
          self._codes[message["pid"]] = message["code"]
          self._changed.notify_all()

  def usable(self) -> bool:
    """Whether the server has imported its modules with one thread only (waits for it)."""
    if not self._ready.wait(_READY_TIMEOUT_S):
      raise RuntimeError(f"The warm-start server took over {_READY_TIMEOUT_S} s to import "
                         f"its modules; its log: {self._log.name}")
    if not self.threads:  # it ended before it was ready
      raise self._dead("importing its modules")
    return self.threads == 1

  def _dead(self, what: str) -> RuntimeError:
    return RuntimeError(f"The warm-start server ended while {what}; its log: {self._log.name}")

  def spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
    read_fd, write_fd = os.pipe()
    try:
      with self._lock:
        _send(self._sock, {"op": "spawn", "argv": argv, "env": env, "cwd": cwd}, [write_fd])
        pid = self._spawned.get(timeout=_SPAWN_TIMEOUT_S)
    except BaseException:
      os.close(read_fd)
      raise
    finally:
      os.close(write_fd)
    if pid < 0:
      os.close(read_fd)
      raise self._dead("starting a process")
    return ForkedProcess(self, pid, os.fdopen(read_fd, "rb"))

  def code(self, pid: int) -> int | None:
    with self._changed:
      return self._codes.get(pid)

  def wait_for(self, pid: int, timeout: float | None) -> None:
    with self._changed:
      if not self._changed.wait_for(lambda: pid in self._codes or self._closed, timeout):
        raise subprocess.TimeoutExpired(["pid", str(pid)], timeout)
      if pid not in self._codes:
        raise self._dead(f"pid {pid} was running")

  def reap(self, pid: int) -> int:
    """Has the server reap `pid` (which has ended) and returns its code, once the pid is
    free (as after Popen.wait); the pid may then be reused, so its code is forgotten."""
    _send(self._sock, {"op": "reap", "pid": pid})
    with self._changed:
      self._changed.wait_for(lambda: pid in self._reaped or self._closed)
      if pid not in self._reaped:
        raise self._dead(f"pid {pid} was reaped")
      self._reaped.discard(pid)
      return self._codes.pop(pid)

  def close(self) -> None:
    # shutdown, not only close: the reader thread's recv holds the socket open otherwise.
    self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()
    try:
      self._server.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self._server.kill()
      self._server.wait()
    self._log.close()
    os.unlink(self._log.name)


_starters: dict[tuple[str, tuple[str, ...]], _Starter] = {}
_starters_lock = threading.Lock()

# What `python tests/mp_worker` imports before it runs anything.
MP_WORKER_PRELOAD = ("jax", "orbax.checkpoint", "orbax_mtc", "mp_worker.common",
                     "mp_worker.contained", "mp_worker.faults", "mp_worker.iterators",
                     "mp_worker.plain", "mp_worker.preempt", "mp_worker.save_restore",
                     "mp_worker.seams")


def enabled() -> bool:
  return os.environ.get("MTC_TEST_COLD_START", "") not in ("1", "true", "yes")


def starter(python: str, preload: tuple[str, ...], env: dict[str, str]) -> _Starter:
  """The session's server for `python` with `preload` imported, started on first use in
  `env` (the environment its imports read; a fork whose own differs there is not warm)."""
  with _starters_lock:
    key = (python, preload)
    if key not in _starters:
      _starters[key] = _Starter(python, preload, {
          **{k: v for k, v in env.items() if not k.startswith("ORBAX_MTC_")},
          "OPENBLAS_NUM_THREADS": "1"})  # no BLAS thread to be missing in the forks
      atexit.register(_starters[key].close)
    return _starters[key]


def mp_server_env() -> dict[str, str]:
  """The environment of the server the multi-process tests' jobs fork from: theirs."""
  from mp_helpers import child_env

  return {**os.environ, **child_env(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def spawn(python: str, preload: tuple[str, ...], server_env: dict[str, str],
          argv: list[str], env: dict[str, str], cwd: str) -> ForkedProcess | None:
  """`argv` (`python -m module ...` or `python path ...`) forked from the server for `python`
  and `preload`; None when it cannot stand for an exec of `argv` in `env` (then exec it)."""
  if not (enabled() and argv[:1] == [python] and _forkable(argv)):
    return None
  server = starter(python, preload, server_env)
  if not server.usable() or server.import_env != _import_env(env):
    return None  # a thread the forks would lack, or other values read at its imports
  return server.spawn(argv, env, cwd)


def _forkable(command: list[str]) -> bool:
  """`python -m module ...`, `python script.py ...` or `python folder ...`."""
  if len(command) < 2:
    return False
  if command[1] == "-m":
    return len(command) > 2
  return not command[1].startswith("-") and os.path.exists(command[1])


def _import_env(env: dict[str, str]) -> dict[str, str]:
  """What of `env` modules may read while imported (JAX's flags, the import path, XLA's
  logging): a fork gets the server's values for those."""
  return {k: v for k, v in env.items()
          if (k.startswith(("JAX_", "PYTHON", "TF_CPP_")) and k != "JAX_COORDINATOR_BIND_ADDRESS")
          and k != "PYTHONUNBUFFERED"}


@functools.cache
def _job_class():
  from orbax_mtc.tools import launch

  class WarmJob(launch.Job):
    """`launch.Job` whose `python tests/mp_worker ...` processes are forked warm."""

    def _spawn(self, process_id: int):
      if self.prefix_output:  # a fork writes into a pipe of ours, never our own stdout
        forked = spawn(sys.executable, MP_WORKER_PRELOAD, mp_server_env(), self.command,
                       self.child_env(process_id), os.getcwd())
        if forked is not None:
          return forked
      return super()._spawn(process_id)

    def _exited_code(self, proc):
      if isinstance(proc, ForkedProcess):
        return proc.exited_code()
      return super()._exited_code(proc)

  return WarmJob


def WarmJob(*args, **kwargs):  # noqa: N802 - a class, made on first use (imports JAX)
  return _job_class()(*args, **kwargs)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
  _server_main(int(sys.argv[2]), sys.argv[3].split(","))
