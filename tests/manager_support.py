"""Fixtures and helpers of the single-process manager tests (test_manager_single.py,
test_manager_edges.py)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import subprocess
import uuid

import jax
import orbax.checkpoint as ocp
import pytest
from conftest import abstract_of, make_state

import orbax_mtc as mtc
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local.format import DATA
from orbax_mtc.local.store import committed_steps, read_manifest


def _options(local_every=2, persistent_every=4, local_keep=2, persistent_keep=None, **kwargs):
  return mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=local_every, max_to_keep=local_keep),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=persistent_every,
                                                 max_to_keep=persistent_keep),
      replication=mtc.ReplicationOptions(replica_axis="data"), **kwargs)


@pytest.fixture
def dirs(shm_dir):
  return shm_dir / "local", shm_dir / "persistent"


@pytest.fixture
def open_manager(dirs, mesh):
  """`open_manager(**options)` -> a manager on `dirs`, closed at teardown."""
  managers = []

  def make(options=None, abstract=None, local=None, persistent=None):
    mgr = mtc.CheckpointManager(local or dirs[0], persistent or dirs[1], mesh,
                                abstract if abstract is not None
                                else abstract_of(make_state(mesh)),
                                options=options or _options())
    managers.append(mgr)
    return mgr

  yield make
  for mgr in managers:
    with contextlib.suppress(Exception):
      mgr.close()


def _composite(state):
  return ocp.args.Composite(state=ocp.args.PyTreeSave(state))


def _save_range(mgr, mesh, steps, single=False):
  """Saves make_state(seed=step) at each step; returns {step: state} and the save results."""
  states, results = {}, {}
  for step in steps:
    states[step] = make_state(mesh, step)
    args = ocp.args.PyTreeSave(states[step]) if single else _composite(states[step])
    results[step] = mgr.save(step, args=args)
  mgr.wait_until_finished()
  return states, results


def _persistent_steps(persistent_dir):
  return sorted(int(p.name) for p in persistent_dir.iterdir() if p.name.isdigit())


def _links(local_dir):
  return {p.name: os.readlink(p) for p in local_dir.iterdir() if p.name.endswith(".restore")}


def _flip_first_shard(step_dir):
  manifest = read_manifest(step_dir)
  shard = manifest.items["state"].leaves[0].shards[0]
  with open(step_dir / DATA, "r+b") as f:
    f.seek(shard.offset)
    byte = f.read(1)
    f.seek(shard.offset)
    f.write(bytes([byte[0] ^ 0x01]))


def _bad_abstract(state, change):
  """A target that no restore can serve: another shape, or PRNG keys where floats were saved
  (another numeric dtype is cast, as Orbax casts)."""
  abstract = abstract_of(state)
  w = abstract["params"]["w"]
  if change == "shape":
    abstract["params"]["w"] = jax.ShapeDtypeStruct((8, 12), w.dtype, sharding=w.sharding)
    return abstract, ["['params']['w']", "(8, 6)", "(8, 12)"]
  keys = jax.random.key(0).dtype
  abstract["params"]["w"] = jax.ShapeDtypeStruct(w.shape, keys, sharding=w.sharding)
  return abstract, ["['params']['w']", "float32", keys.name]


def _mount_tmpfs(path, options):
  path.mkdir()
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
  if result.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here ({options}): {result.stderr.strip()}")


@pytest.fixture
def tmpfs_mount(shm_dir):
  """`tmpfs_mount(options)` mounts a tmpfs under shm_dir; unmounted at teardown."""
  mounts = []

  def mount(options):
    path = shm_dir / f"mnt-{uuid.uuid4().hex[:8]}"
    _mount_tmpfs(path, options)
    mounts.append(path)
    return path

  try:
    yield mount
  finally:
    for path in reversed(mounts):
      subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _lkg_consistent(local_dir):
  """Every LKG link of the directory points at a committed step, the newest one."""
  committed = committed_steps(local_dir)
  links = _links(local_dir)
  for name, target in links.items():
    assert (local_dir / target).is_file(), \
        f"LKG link {name} -> {target} points at no committed step (committed: {committed})"
    assert target == lkg.link_target(lkg.parse_link_name(name).step)
  if committed:
    assert list(links.values()) == [lkg.link_target(committed[-1])]


@dataclasses.dataclass
class _TrainState:
  """A flax-TrainState-like pytree: attribute keys, and a namedtuple inside."""

  step: jax.Array
  params: dict
  opt_state: tuple


jax.tree_util.register_dataclass(_TrainState, data_fields=["step", "params", "opt_state"],
                                 meta_fields=[])


_Moments = collections.namedtuple("_Moments", ["mu", "nu"])
