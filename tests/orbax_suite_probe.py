"""pytest plugin for runs of Orbax's own CheckpointManager suite (docs/orbax-conformance.md).

Load it with `-p orbax_suite_probe` (tests/ on PYTHONPATH). It counts, per test, how often the
RAM tier of `orbax_mtc.CheckpointManager` saved and restored, so a run with the parent-style
RAM tier switched on shows that the tier was exercised, not only that the tests passed. A RAM
save is a `RamSaver.save` call that returns; a RAM restore is a `RamRestore.restore` whose
result is `found`. The counts go to `$ORBAX_MTC_PROBE_OUT/probe-p<process>.json` when the
session ends.
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path

from orbax_mtc.restore.executor import RamRestore
from orbax_mtc.save.ram import RamSaver

_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = ["<outside a test>"]


def _count(name: str, method):
  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    result = method(self, *args, **kwargs)
    if name != "ram_restore" or result.found:
      _counts[_current[0]][name] += 1
    return result

  return wrapper


def pytest_configure(config):
  RamSaver.save = _count("ram_save", RamSaver.save)
  RamRestore.restore = _count("ram_restore", RamRestore.restore)


def pytest_runtest_setup(item):
  _current[0] = item.nodeid.split("::")[-1]


def pytest_sessionfinish(session):
  out = os.environ.get("ORBAX_MTC_PROBE_OUT")
  if not out:
    return
  import jax

  totals = collections.Counter()
  for counter in _counts.values():
    totals.update(counter)
  record = {"totals": dict(totals),
            "tests_with_ram_save": sum(1 for c in _counts.values() if c["ram_save"]),
            "tests_with_ram_restore": sum(1 for c in _counts.values() if c["ram_restore"]),
            "per_test": {k: dict(v) for k, v in sorted(_counts.items())}}
  Path(out).mkdir(parents=True, exist_ok=True)
  (Path(out) / f"probe-p{jax.process_index()}.json").write_text(json.dumps(record, indent=1))
