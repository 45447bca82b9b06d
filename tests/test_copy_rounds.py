"""After the first step, a step's peer copies take no agreement round of their own: they are
planned with the sizes the first one agreed (peers/size_plan.py). Two real JAX processes, a
ROUND line per agreement round (`hooks.count_rounds`), the copies checked on disk."""

from __future__ import annotations

import re
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, new_root, tail
from mp_worker.events import MARK

from orbax_mtc.peers import copy_store as peer_store

pytestmark = pytest.mark.timeout(240)
_EVENT = re.compile(r"^\[node (\d+)\] .*?" + re.escape(MARK) + r" (SAVING|SAVED|ROUND) (.*)$")
COPY_ROUND = "the_peer_copies_of_a_step"


def rounds_per_call(lines: list[str]) -> dict[int, dict[int, list[str]]]:
  """node -> step -> the rounds made inside that step's save() call, in order."""
  calls: dict[int, dict[int, list[str]]] = {}
  current: dict[int, int | None] = {}
  for line in lines:
    m = _EVENT.match(line)
    if not m:
      continue
    node, kind, rest = int(m.group(1)), m.group(2), m.group(3)
    fields = dict(token.partition("=")[::2] for token in rest.split())
    if kind == "SAVING":
      current[node] = int(fields["step"])
      calls.setdefault(node, {})[current[node]] = []
    elif kind == "SAVED":
      current[node] = None
    elif current.get(node) is not None:
      calls[node][current[node]].append(fields["what"])
  return calls


def test_after_the_first_step_the_copies_go_without_a_round_and_land(tmp_path):
  root = new_root("copy-rounds")
  try:
    result, out = mp_helpers.run_job(
        ["save", "--steps", "16", "--local-interval", "4", "--local-keep", "2",
         "--persistent-interval", "100", "--persistent-dir", str(tmp_path / "persistent"),
         "--replicas", "2", "--count-rounds"], 2, root, devices=1, timeout_s=120)
    assert_ok(result, out)
    calls = rounds_per_call(out.lines)
    assert sorted(calls) == [0, 1] and all(sorted(c) == list(range(16)) for c in calls.values())
    for node, by_step in calls.items():
      # The same rounds, in the same order, on both processes (rule 2).
      assert by_step == calls[0], f"node {node} made other rounds:\n{tail(out)}"
      copy_rounds = {step for step, names in by_step.items() if COPY_ROUND in names}
      # Step 0's copies: the status round (with the sizes; at its save here, whose backup the
      # loop waits for); the first planned copies (step 4's, in the calls after its save)
      # place spare chunks of their new lengths once (transport's reserve round). From then
      # on the copies make no round: steps 8 and 12 went out through calls 9 to 15, and
      # their outcome rode in the next save's census. (Copies that cannot start before the
      # next save go at that save, and their outcome takes a round at the call after it,
      # when the next step's copies start: not here, where a tiny write is done within a
      # call or two of the four.)
      assert copy_rounds and max(copy_rounds) <= 7, (copy_rounds, tail(out))
      # Every local save still makes its census (the copies' outcome rides in it).
      assert all(any(n.startswith("the_save_of_step") for n in by_step[s]) for s in (4, 8, 12))
    # Every later step's copies landed on the peer and rebuild its step, checksums verified.
    for holder, source in ((0, 1), (1, 0)):
      store = peer_store.PeerStore(root / f"node{holder}", max_to_keep=None)
      held = [step for src, step in store.copies() if src == source]
      assert max(held) == 12, held
      manifest, _ = store.read(source, 12, root / f"node{holder}" / "12")
      assert (manifest.step, manifest.process_index) == (12, source)
  finally:
    shutil.rmtree(root, ignore_errors=True)
