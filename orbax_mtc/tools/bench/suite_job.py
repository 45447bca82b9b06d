"""One process's view of an `orbax-mtc bench suite` job (for `suite_worker`): mesh, barriers,
slowest-process timing, test states and managers."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Job:
  """This process's view of the job: mesh, barriers, slowest-process timing, managers."""

  def __init__(self, args: argparse.Namespace):
    import jax
    import jax.numpy as jnp

    from orbax_mtc import distributed

    self.args = args
    self.me, self.n = jax.process_index(), jax.process_count()
    self.replicas = 2 if self.n >= 2 and self.n % 2 == 0 else 1
    self.devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    self.mesh = self.layout(self.replicas)
    self.local_root = Path(distributed.local_directory())
    self._barriers = 0
    self.state_bytes = 0  # per process, of the size being measured
    self.backend = jax.default_backend()
    self.fresh_state = args.fresh_state == "on" or (
        args.fresh_state == "auto" and self.backend != "cpu")
    self._copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
    if "emergency" in args.contenders and self.replicas > 1:
      from orbax.checkpoint._src.multihost import multihost as ocp_multihost

      # What MaxText does once before building Orbax's emergency manager.
      ocp_multihost.initialize_runtime_to_distributed_ids()
      ocp_multihost.initialize_distributed_to_device_ids()

  def layout(self, replicas: int):
    """A (data=replicas, model=rest) mesh over one device per process."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(self.devices).reshape(replicas, -1), ("data", "model"))

  def barrier(self) -> None:
    from jax.experimental import multihost_utils

    self._barriers += 1
    multihost_utils.sync_global_devices(f"suite-{self._barriers}")

  def realign_orbax_operations(self) -> int:
    """Brings Orbax's per-process operation counter to the same value on every process;
    returns how far this process was behind.

    Orbax numbers each save (its signals and barriers are keyed by that number) with a
    counter in each process. Its emergency manager saves from replica 0 to persistent storage
    and from replica 1 to RAM, so the processes' counters drift apart; a later save by every
    process (the next contender's) then waits, on the processes behind, for a signal sent
    under another number, and hangs whenever it arrives before the primary host made the
    step's folder.
    """
    import numpy as np
    from jax.experimental import multihost_utils
    from orbax.checkpoint._src.futures import synchronization

    if self.n == 1:
      return 0
    mine = int(synchronization.OperationIdGenerator.get_current_operation_id())
    behind = int(np.max(multihost_utils.process_allgather(np.asarray([mine])))) - mine
    for _ in range(behind):
      synchronization.OperationIdGenerator.next_operation_id()
    return behind

  def slowest(self, seconds: float) -> float:
    import numpy as np
    from jax.experimental import multihost_utils

    if self.n == 1:
      return seconds
    return float(np.max(multihost_utils.process_allgather(np.asarray([seconds]))))

  def all_true(self, value: bool) -> bool:
    import numpy as np
    from jax.experimental import multihost_utils

    if self.n == 1:
      return value
    return bool(np.min(multihost_utils.process_allgather(np.asarray([int(value)]))))

  def measure(self, res: dict, name: str, fn: Callable[[], Any], *, warm: bool = False) -> Any:
    """Runs fn on every process after a barrier; records the slowest process's seconds.

    `warm`: fn reads the state into new memory (a restore, a raw read); first touch and free
    as much memory, so that each such contender starts from the same warm pages.
    """
    if warm:
      from orbax_mtc.tools.bench import limits

      limits.warm_memory(self.state_bytes)
    self.barrier()
    start = time.perf_counter()
    out = fn()
    res.setdefault(name, []).append(self.slowest(time.perf_counter() - start))
    return out

  def fresh(self, state: Any) -> Any:
    """With --fresh-state, a copy of `state` in new device buffers, as a training step leaves
    its arrays (no host copy cached yet); otherwise `state` itself."""
    if not self.fresh_state:
      return state
    import jax

    return jax.block_until_ready(self._copy_tree(state))

  def measure_device_to_host(self, res: dict, name: str, state: Any) -> None:
    """Times the device-to-host copy of a fresh device copy of `state` (--fresh-state)."""
    from orbax_mtc.tools.bench import limits

    probe = self.fresh(state)
    self.measure(res, name, lambda: limits.device_to_host(probe))

  def record(self, res: dict, name: str, seconds: float) -> None:
    res.setdefault(name, []).append(self.slowest(seconds))

  def save_restore_reps(self, res: dict, prefix: str, state: Any,
                        save: Callable[[int, Any], Any], finish: Callable[[], Any],
                        restore: Callable[[int], Any], what: str) -> None:
    """`--reps` timed saves and restores of a contender, after one untimed warm-up save:
    `<prefix>_blocking_s` (the save call), `<prefix>_save_s` (until `finish` returns) and
    `<prefix>_restore_s`; the first timed restore must equal `state` bit for bit."""
    import jax

    for rep in range(self.args.reps + 1):
      step = rep + 1
      current = self.fresh(state)
      self.barrier()
      start = time.perf_counter()
      save(step, current)
      blocking = time.perf_counter() - start
      finish()
      total = time.perf_counter() - start
      if rep == 0:
        continue
      self.record(res, f"{prefix}_blocking_s", blocking)
      self.record(res, f"{prefix}_save_s", total)
      restored = self.measure(res, f"{prefix}_restore_s", lambda s=step: jax.block_until_ready(
          restore(s)), warm=True)
      if rep == 1 and not self.equal(restored, state):
        raise AssertionError(f"{what} restore is not bit-exact")
      del restored

  def make_state(self, mib: int, seed: int, mesh=None) -> dict:
    """`mib` MiB per process: 3/4 float32, 1/4 bfloat16, plus a replicated step scalar."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh or self.mesh
    sharding, scalar = NamedSharding(mesh, P("model")), NamedSharding(mesh, P())
    cols, k = 1024, mesh.shape["model"]
    rows_w = max(1, mib * 2**20 * 3 // 4 // 4 // cols) * k
    rows_h = max(1, mib * 2**20 // 4 // 2 // cols) * k
    key = jax.random.PRNGKey(seed)
    w = jax.jit(lambda k: jax.random.normal(k, (rows_w, cols), jnp.float32),
                out_shardings=sharding)(key)
    h = jax.jit(lambda k: jax.random.normal(k, (rows_h, cols), jnp.bfloat16),
                out_shardings=sharding)(key)
    step = jax.jit(lambda: jnp.int32(seed), out_shardings=scalar)()
    return {"w": w, "h": h, "step": step}

  def equal(self, a: Any, b: Any) -> bool:
    import jax
    import jax.numpy as jnp

    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    same = len(left) == len(right) and all(
        bool(jnp.array_equal(x, y)) for x, y in zip(left, right, strict=True))
    return self.all_true(same)

  def mtc_manager(self, directory: Path, abstract: Any, *, peers: bool, every: int = 1,
                  mesh=None):
    import orbax_mtc as mtc

    options = mtc.CheckpointManagerOptions(
        local=mtc.LocalCheckpointOptions(save_interval_steps=every, max_to_keep=1),
        persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**9),
        replication=mtc.ReplicationOptions(replica_axis="data",
                                           peers_per_node=None if peers else 0))
    return mtc.CheckpointManager(directory, Path(self.args.persistent) / directory.name,
                                 mesh or self.mesh, abstract, options=options)
