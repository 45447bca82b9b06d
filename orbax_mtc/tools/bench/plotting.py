"""matplotlib for the benchmarks' plots, loaded only when a plot is drawn (an optional
dependency: `pip install 'orbax-mtc[bench]'`)."""

from __future__ import annotations

from typing import Any

NOT_INSTALLED = "matplotlib is not installed: pip install 'orbax-mtc[bench]'"


def pyplot() -> Any | None:
  """`matplotlib.pyplot` on the file-only Agg backend, or None without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt
