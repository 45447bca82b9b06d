"""local/saved_counts.py: which process count saved each step folder, read once per folder."""

from __future__ import annotations

import types

from orbax_mtc.local.format import LocalTierError
from orbax_mtc.local.saved_counts import SavedCounts


def test_counts_are_read_once_per_folder_and_again_for_a_folder_renamed_in(tmp_path):
  counts = {"1": 2, "2": 1, "3": 1}  # by folder: the count its manifest names
  reads: list[str] = []

  def read(folder):
    reads.append(folder.name)
    if folder.name == "4":
      raise LocalTierError("no manifest")
    return types.SimpleNamespace(process_count=counts[folder.name])

  for step in ("1", "2", "3", "4"):
    (tmp_path / step).mkdir()
  saved = SavedCounts(tmp_path, 1, read)
  # Step 1 another count saved is left out; unreadable step 4 stays listed (a restore finds it).
  assert saved.of_this_count([1, 2, 3, 4]) == [2, 3, 4]
  assert saved.of_this_count([1, 2, 3, 4]) == [2, 3, 4] and sorted(reads) == ["1", "2", "3", "4"]
  # A write-back of step 1 on this layout: a new folder renamed in, read again.
  (tmp_path / "1").rename(tmp_path / "old")
  (tmp_path / "new").mkdir()
  (tmp_path / "new").rename(tmp_path / "1")
  counts["1"] = 1
  assert saved.of_this_count([1, 2]) == [1, 2] and reads.count("1") == 2
  # A commit here is known without reading; retired steps leave the cache.
  (tmp_path / "5").mkdir()
  saved.record(5, 1)
  assert saved.of_this_count([5]) == [5] and "5" not in reads
  assert set(saved._known) == {5}


def test_an_unknown_process_count_lists_every_step(tmp_path):
  saved = SavedCounts(tmp_path, None, lambda folder: 1 / 0)
  assert saved.of_this_count([3, 7]) == [3, 7]
