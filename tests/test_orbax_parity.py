"""Parity with the installed Orbax `experimental.emergency` API (issue 30).

The option dataclasses and constructor signatures are compared with Orbax's field by field, so a
field or parameter a new Orbax adds fails here until we take a position on it in `DIFFERENCES`
(and docs/api.md). Then `mtc.ReplicatorCheckpointManager`, built exactly as MaxText builds
Orbax's, runs against the replicator simulator and restores bit for bit.

Run as a script (`python tests/test_orbax_parity.py worker ...`) this file is the job process
of those runs.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from mp_helpers import REPO_ROOT
from orbax_parity_support import (
    DIFFERENCES,
  _assert_positions_taken,
  _default,
  _differences,
  _option_pairs,
  _orbax,
  _params,
)


@pytest.mark.parametrize("pair", range(5), ids=["local", "persistent", "manager",
                                                 "multiprocessing", "replicator"])
def test_option_fields_and_defaults_match_orbax(pair):
  ours, theirs = _option_pairs()[pair]
  assert ours.__name__ == theirs.__name__
  mine = [(f.name, _default(f)) for f in dataclasses.fields(ours)]
  orbax = [(f.name, _default(f)) for f in dataclasses.fields(theirs)]
  _assert_positions_taken(_differences(ours.__name__, mine, orbax), {ours.__name__})
  # Orbax's fields come first, in Orbax's order: positional arguments mean the same.
  shared = [name for name, _ in mine if name in dict(orbax)]
  assert shared == [name for name, _ in orbax]
  assert [name for name, _ in mine[:len(shared)]] == shared


def test_constructor_signatures_match_orbax():
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc.forms import arguments as constructor

  emergency, replicator = _orbax()
  cases = [
      ("CheckpointManager.__init__", constructor.MULTI_TIER_SIGNATURE,
       inspect.signature(emergency.CheckpointManager.__init__)),
      ("ReplicatorCheckpointManager.__init__",
       inspect.signature(mtc.ReplicatorCheckpointManager.__init__),
       inspect.signature(replicator.ReplicatorCheckpointManager.__init__)),
      ("ocp.CheckpointManager.__init__", constructor.PARENT_STYLE_SIGNATURE,
       inspect.signature(ocp.CheckpointManager.__init__)),
  ]
  found: dict[tuple[str, str], str] = {}
  for owner, ours, theirs in cases:
    mine, orbax = _params(ours), _params(theirs)
    found.update(_differences(owner, mine, orbax))
    # The shared parameters in the same order (positional calls mean the same).
    shared = [n for n, _ in mine if n in dict(orbax)]
    assert shared == [n for n, _ in orbax if n in dict(mine)], owner
  _assert_positions_taken(found, {owner for owner, _, _ in cases})


def test_replicator_manager_has_every_public_method_of_orbax_with_its_signature():
  import orbax_mtc as mtc

  _, replicator = _orbax()
  theirs, ours = replicator.ReplicatorCheckpointManager, mtc.ReplicatorCheckpointManager
  for name in (n for n in dir(theirs) if not n.startswith("_")):
    assert hasattr(ours, name), name
    if callable(getattr(theirs, name)):
      assert _params(inspect.signature(getattr(ours, name))) == \
          _params(inspect.signature(getattr(theirs, name))), name
    else:
      assert isinstance(getattr(ours, name), property), name


def test_every_difference_is_documented():
  text = (REPO_ROOT / "docs" / "api.md").read_text()
  for owner, name in DIFFERENCES:
    assert f"`{name}`" in text, f"docs/api.md does not mention {owner}.{name}"
  for _, theirs in _option_pairs():
    for field in dataclasses.fields(theirs):
      assert f"`{field.name}`" in text, \
          f"docs/api.md does not mention {theirs.__name__}.{field.name}"
