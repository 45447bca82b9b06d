"""Output helpers every `orbax-mtc` verb shares (docs/cli.md's conventions): results on
stdout, errors and progress bars on stderr, one JSON document with `--json`.

The verbs' modules import these from here, never from `cli` (which imports the verbs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

# Seconds of work before a progress bar is drawn, so that quick runs draw none (a line
# printed above a bar with bar.write draws it at once).
PROGRESS_DELAY_S = 1.0


def version() -> str:
  """The version of the orbax-mtc code that runs (`orbax_mtc.__version__`).

  Read from the package rather than the installed distribution's metadata, so a source
  checkout on PYTHONPATH reports itself too; the package is already imported by then (this
  module lives in it), so this costs nothing.
  """
  import orbax_mtc

  return orbax_mtc.__version__


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


def warning(prog: str, message: str) -> None:
  """Prints `prog: warning: message` to stderr."""
  print(f"{prog}: warning: {message}", file=sys.stderr)


def directory_arg(text: str) -> str:
  """argparse type of a DIR argument: refuses the empty string, which every path library
  reads as the current directory (a report on `.` that nobody asked for)."""
  if not text.strip():
    raise argparse.ArgumentTypeError(
        f"{text!r} is an empty path: give a checkpoint folder (a path, or gs://bucket/path); "
        "for the current directory, write '.'")
  return text


def count_arg(minimum: int) -> Callable[[str], int]:
  """argparse type of a whole number >= `minimum`: argparse then names the flag in the
  error (`argument --keep-latest: ...`)."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"expected a whole number >= {minimum}, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
    return value

  return parse


class _NoMissingMetadataWarning(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Metadata file does not exist")


@contextlib.contextmanager
def no_missing_metadata_warnings() -> Iterator[None]:
  """Drops Orbax's "Metadata file does not exist" warning (one per step) while a verb reads a
  persistent folder: the verb reports such a step itself (status/verify: partial; gc: the
  folder's time stands in for the commit time a checkpoint of an older Orbax lacks)."""
  logger = logging.getLogger("absl")  # Orbax logs through absl.logging
  quiet = _NoMissingMetadataWarning()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)
