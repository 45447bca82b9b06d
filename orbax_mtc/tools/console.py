"""Output helpers every `orbax-mtc` verb shares (docs/cli.md's conventions): results on
stdout, errors and progress bars on stderr, one JSON document with `--json`.

The verbs' modules import these from here, never from `cli` (which imports the verbs).
"""

from __future__ import annotations

import json
import sys
from typing import Any

# Seconds of work before a progress bar is drawn, so that quick runs draw none (a line
# printed above a bar with bar.write draws it at once).
PROGRESS_DELAY_S = 1.0


def version() -> str | None:
  """The installed orbax-mtc version, or None when the package is not installed."""
  from importlib import metadata

  try:
    return metadata.version("orbax-mtc")
  except metadata.PackageNotFoundError:
    return None


def progress(*, total: float | None, desc: str, unit: str = "it", enabled: bool = True,
             file=None, delay: float = PROGRESS_DELAY_S, **kwargs):
  """A tqdm progress bar on stderr (or `file`).

  Off when `enabled` is false (--json, --quiet); silent when the stream is not a terminal
  (tqdm's disable=None), so logs and pipes never get bar characters.
  """
  from tqdm import tqdm  # only verbs that draw a bar pay for the import

  return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr if file is None else file,
              disable=None if enabled else True, delay=delay, leave=False,
              dynamic_ncols=True, **kwargs)


def print_json(document: dict[str, Any]) -> None:
  """Writes one JSON document (a --json result) to stdout."""
  sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
  sys.stdout.flush()


def error(prog: str, message: str) -> None:
  """Prints `prog: error: message` to stderr, as argparse does for usage errors."""
  print(f"{prog}: error: {message}", file=sys.stderr)
