"""Which array shards each process holds under a tree's shardings (pure).

Replication sends a receiver only the shards it does not hold itself (a twin holds them byte
for byte: `skip_ordinals`), and restore tells twins apart by them (`shard_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import specs as local_specs

ShardKey = tuple[str, str, local_format.Index]  # (item, leaf path, global index)


def shard_sets(trees: dict[str, Any], process_count: int) -> list[frozenset[ShardKey]]:
  """Per process, the (item, path, index) of every array shard it holds under these shardings.

  Leaves are jax.Arrays or ShapeDtypeStructs with a sharding; others (numpy, scalars) are held
  whole by every process and are not part of the sets. A PRNG key leaf's indices span its key
  data's dims too, as in the manifest.
  """
  sets: list[set[ShardKey]] = [set() for _ in range(process_count)]
  for item_name, tree in trees.items():
    if tree is None:
      continue
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      sharding = getattr(leaf, "sharding", None)
      shape = getattr(leaf, "shape", None)
      if sharding is None or shape is None or not hasattr(sharding, "devices_indices_map"):
        continue
      path = jax.tree_util.keystr(key_path)
      key_dims = tuple((0, n) for n in local_specs.key_data_dims(getattr(leaf, "dtype", None)))
      for device, index in sharding.devices_indices_map(tuple(shape)).items():
        sets[device.process_index].add(
            (item_name, path, local_specs.normalize_index(index, tuple(shape)) + key_dims))
  return [frozenset(s) for s in sets]


def shard_groups(sets: Sequence[frozenset[ShardKey]]) -> list[int]:
  """Equal ids for processes that hold exactly the same shards (data-parallel twins)."""
  first: dict[frozenset[ShardKey], int] = {}
  return [first.setdefault(s, i) for i, s in enumerate(sets)]


def skip_ordinals(manifest: local_format.StepManifest, receiver: frozenset[ShardKey]) -> set[int]:
  """Ordinals of array shards the receiver holds itself (identical bytes: not sent)."""
  return {i for i, (name, leaf, shard) in enumerate(local_read.manifest_entries(manifest))
          if leaf.kind == "array" and (name, leaf.path, shard.index) in receiver}
