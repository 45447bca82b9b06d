"""Whether a `gs://` directory's endpoint can be reached, asked before any Cloud Storage call.

Without a network, gcsfs retries each request six times with growing back-off (about 35 s)
and logs every failed attempt with its traceback; a verb that probes the endpoint first fails
in at most PROBE_TIMEOUT_S with one line that says what to fix.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

# Seconds to wait for a TCP connection to the Cloud Storage endpoint. A reachable endpoint
# answers in milliseconds; a dropped route would otherwise hold the verb for the whole time.
PROBE_TIMEOUT_S = 5.0

_DEFAULT_ENDPOINT = "https://storage.googleapis.com"


class UnreachableError(Exception):
  """The directory's store cannot be used from here; the message says why and what to do."""


def gcs_endpoint() -> str:
  """The URL gcsfs sends requests to: STORAGE_EMULATOR_HOST (an emulator) or Cloud Storage."""
  host = os.environ.get("STORAGE_EMULATOR_HOST", "")
  if host in ("", "default"):
    return _DEFAULT_ENDPOINT
  return host if host.startswith(("http://", "https://")) else f"http://{host}"


def check(directory: str) -> None:
  """Returns when `directory` is local or its `gs://` endpoint accepts a connection.

  Args:
    directory: a path, or a URL such as gs://bucket/path.

  Raises:
    UnreachableError: the GCS extra is not installed, or the endpoint refuses or does not
      answer a connection within PROBE_TIMEOUT_S.
  """
  if not directory.startswith("gs://"):
    return
  try:
    import gcsfs  # noqa: F401 - what etils.epath uses for gs://
  except ImportError as e:
    raise UnreachableError(f"{directory}: reading it needs the GCS extra: pip install "
                           f"'orbax-mtc[gcs]' ({e})") from e
  endpoint = gcs_endpoint()
  url = urllib.parse.urlsplit(endpoint)
  port = url.port or (443 if url.scheme == "https" else 80)
  where = f"{url.hostname}:{port}"
  try:
    with socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S):
      pass
  except OSError as e:
    why = (f"no answer within {PROBE_TIMEOUT_S:g} s" if isinstance(e, TimeoutError)
           else (e.strerror or str(e)).lower())
    fix = ("start the emulator or unset STORAGE_EMULATOR_HOST"
           if "STORAGE_EMULATOR_HOST" in os.environ and endpoint != _DEFAULT_ENDPOINT
           else "check this machine's network, DNS and firewall")
    raise UnreachableError(
        f"{directory}: cannot reach Cloud Storage at {where} ({why}): {fix}, then try "
        "again") from None
