"""The README and the docs it points to say what a new user needs, once and where it is looked
for: the map of the field (comparison table, when to choose standalone or managed mode), what
has not run where, how long the test command takes and what its MaxText tests need, and how
to reproduce the Orbax-suite figures from a clone."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CONTENDERS = ("Orbax emergency", "Orbax P2P", "ReplicatorCheckpointManager",
              "nvidia-resiliency-ext", "DLRover")


def _section(text: str, heading: str) -> str:
  """The text under `heading` up to the next heading of the same or a higher level (lines in
  fenced code blocks are not headings)."""
  level = len(heading.split(" ", 1)[0])
  lines = text.splitlines(keepends=True)
  start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == heading) + 1
  fenced = False
  for i in range(start, len(lines)):
    if lines[i].startswith("```"):
      fenced = not fenced
    hashes = len(lines[i]) - len(lines[i].lstrip("#"))
    if not fenced and 0 < hashes <= level and lines[i][hashes:hashes + 1] == " ":
      return "".join(lines[start:i])
  return "".join(lines[start:])


def _table_rows(text: str) -> list[list[str]]:
  return [[c.strip() for c in line.strip().strip("|").split("|")]
          for line in text.splitlines() if line.startswith("|")]


def test_readme_puts_the_project_beside_each_contender_in_a_table():
  section = _section(README, "## Beside the others")
  rows = _table_rows(section)
  header = rows[0]
  assert header[1] == "orbax-mtc" and len(header) == 7
  for name in CONTENDERS:
    assert sum(name in cell for cell in header) == 1, f"no column for {name}: {header}"
  labels = [row[0] for row in rows[2:]]
  assert "what it does that orbax-mtc does not" in labels
  assert all(len(row) == len(header) for row in rows), "a row has the wrong number of cells"
  assert "docs/comparison.md" in section and "standalone" in section and "managed" in section
  # Right after "How it works", before the commands.
  assert README.index("## How it works") < README.index("## Beside the others") < \
      README.index("## The two commands")


def test_comparison_doc_goes_point_by_point_and_says_when_to_choose_each_mode():
  doc = (REPO / "docs" / "comparison.md").read_text()
  rows = _table_rows(_section(doc, "## Point by point"))
  header = rows[0]
  for name in ("orbax-mtc", *("Orbax emergency", "Orbax P2P", "Orbax replicator + GKE",
                              "NVIDIA NVRx", "DLRover Flash Checkpoint")):
    assert sum(name in cell for cell in header) == 1, name
  assert len(rows) >= 12 and all(len(row) == len(header) for row in rows)
  theirs = _section(doc, "## What they do that orbax-mtc does not")
  for name in ("Orbax P2P", "replicator", "NVIDIA", "DLRover", "PyTorch"):
    assert name in theirs, name
  when = _section(doc, "## When to choose standalone or managed mode")
  assert "Choose **standalone**" in when and "Choose **managed**" in when
  assert "benchmarks.md#orbax-p2p-in-the-suite" in doc
  bench = (REPO / "docs" / "benchmarks.md").read_text()
  assert "## Orbax P2P in the suite" in bench


def test_readme_says_once_near_the_top_what_has_not_run_where():
  marker = "**What has not run where.**"
  assert README.count(marker) == 1
  assert README.index(marker) < README.index("## How it works")
  paragraph = README[README.index(marker):].split("\n\n", 1)[0]
  for fact in ("Nothing has run on a real TPU", "on a GKE\ncluster", "under GKE's replicator",
               "real Pax", "TPU v2-v4 and v5e created through the Cloud TPU API",
               "not TPUs in\nGKE", "a JAX job on\nGPUs under the replicator",
               "outside what GKE documents"):
    assert fact in paragraph, fact


def test_readme_test_command_says_how_long_it_takes_and_what_maxtext_needs():
  section = _section(README, "## The two commands")
  marked = section[section.index("<!-- test-command -->"):]
  # .ci/run takes the second line after the marker: it must stay the command itself.
  assert marked.splitlines()[2] == "pip install -e '.[test]' && python -m pytest -q tests"
  before = section[:section.index("<!-- test-command -->")]
  # The figures change with the suite; that they are there, and say what they measure, not.
  assert re.search(r"\d+ passed, \d+ skipped in about \d+ minutes on a 2-core VM",
                   before.replace("\n", " "))
  assert re.search(r"CI took \d+ s", before.replace("\n", " "))
  after = marked.split("```", 3)[-1]
  assert "need Python 3.12" in after and "skip" in after


def test_orbax_conformance_reproduces_from_a_clone_with_the_runner_in_the_repository():
  doc = (REPO / "docs" / "orbax-conformance.md").read_text()
  commands = _section(doc, "## Commands, from a clone")
  assert "tools/orbax_suites/requirements.txt" in commands
  assert (REPO / "tools" / "orbax_suites" / "requirements.txt").is_file()
  runs = [line for line in commands.splitlines() if line.lstrip().startswith("$PY $R")]
  assert len(runs) >= 3 and all("--fetch" in line for line in runs)
  assert "$SUITE" not in doc  # no folder the reader has to make by hand
  # Every file the docs name in tools/orbax_suites/ is in the repository; the upstream
  # files are not.
  for name in set(re.findall(r"tools/orbax_suites/([\w.]+)", doc)):
    assert (REPO / "tools" / "orbax_suites" / name).is_file(), name
  committed = {p.name for p in (REPO / "tools" / "orbax_suites").iterdir()}
  assert not committed & {"checkpoint_manager_test.py", "emergency_checkpoint_manager_test.py",
                          "multiprocess_test.py"}
