"""The save agreement's reductions across 3 real JAX processes (collectives.allreduce: one
jitted shard_map all-gather, or psum/pmax for rounds too large to gather, over one device per
process), with one and with several devices per process: every process's answer equals the
one simulated from every process's facts (`mp_worker reduce`)."""

from __future__ import annotations

import re
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, new_root, tail

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("devices", [1, 3])
def test_the_real_reduction_gives_the_simulated_answer(devices):
  root = new_root(f"reduce-{devices}")
  try:
    result, out = mp_helpers.run_job(["reduce"], 3, root, devices=devices, timeout_s=150)
    assert_ok(result, out)
    lines = [m.groupdict() for m in map(re.compile(
        r"REDUCE process=(?P<p>\d+) case=(?P<case>\w+) path=(?P<path>\w+) devices=(?P<d>\d+) same=(?P<same>\d) "
        r"rounds=(?P<rounds>\d+) ram=(?P<ram>\[.*?\]) faulty=(?P<faulty>\[.*?\])").search,
        out.lines) if m]
    assert len(lines) == 12, tail(out)
    assert {(line["case"], line["path"]) for line in lines} == {
        (c, p) for c in ("plain", "faults") for p in ("gathered", "reduced")}, tail(out)
    for line in lines:
      assert line["same"] == "1" and line["d"] == str(devices), tail(out)
      # Node 1 lacks 10, 20 and 2**40: a coverage round lists 20 (node 0 holds its copy).
      # 20 and 2**40 are not agreed yet: a second census gives them slots.
      assert line["ram"] == "[20]", tail(out)
      if line["case"] == "plain":  # census x 2, coverage
        assert line["rounds"] == "3" and line["faulty"] == "[]", tail(out)
      else:  # census x 2, coverage, names, messages
        assert line["rounds"] == "5" and line["faulty"] == "[1]", tail(out)
  finally:
    shutil.rmtree(root, ignore_errors=True)
