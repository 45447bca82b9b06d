"""OS plumbing for `launch`: a free loopback port, process-group kills, signal masking, and
shell-style exit codes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator


def free_port() -> int:
  """A TCP port that is free on 127.0.0.1 now (the coordinator binds it a moment later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def shell_code(returncode: int) -> int:
  """Popen's -N (killed by signal N) as a shell reports it, 128+N."""
  return 128 - returncode if returncode < 0 else returncode


class SecondSigterm(Exception):
  """Raised in the main thread by a second SIGTERM while waiting for a graceful exit."""


def killpg(pgid: int, sig: int) -> None:
  """Sends `sig` to process group `pgid`; a group already gone (or not ours) is ignored."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(pgid, sig)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
  """Defers SIGINT/SIGTERM so a second Ctrl-C cannot interrupt killing and reaping children."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
