"""Where a benchmark's results go, the same for every `orbax-mtc bench` verb (docs/cli.md).

Without `--json`: progress lines and the table on stdout. With `--json`: stdout holds one
JSON document and nothing else; progress lines and the table go to stderr. Files under
`--out` are written either way.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, TextIO

from orbax_mtc.tools import console


def add_json_flag(parser: argparse.ArgumentParser, schema: str, *, also: str = "",
                  **kwargs: Any) -> None:
  """Adds `--json` (print one `schema` document on stdout); `also` ends its help, `kwargs`
  replace store_true."""
  if not kwargs:
    kwargs["action"] = "store_true"
  parser.add_argument(
      "--json", **kwargs,
      help=f"print one JSON document ({schema}) on stdout and nothing else; the progress "
      f"lines and the table go to stderr{also} (default: off)")


def text(as_json: bool) -> TextIO:
  """Where progress lines and the table go: stderr under --json, else stdout."""
  return sys.stderr if as_json else sys.stdout


def finite(value: Any) -> Any:
  """`value` with every NaN or infinity replaced by None: strict JSON has neither, and a
  figure that was not measured is null (docs/cli.md)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite(v) for v in value]
  return value


def emit(as_json: bool, document: dict[str, Any], table: str) -> None:
  """Prints the results: the table on stdout, or the document on stdout and the table on
  stderr."""
  print(table, file=text(as_json), flush=True)
  if as_json:
    console.print_json(finite(document))
