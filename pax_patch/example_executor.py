"""A Pax-shaped training executor on `pax_patch`, for tests and as a worked example.

paxml cannot be installed beside current JAX, so this loop stands in for Pax's executor
(paxml/executors.py): our own code, the same calls in the same order.

  set-up     create_checkpointer(task_p, job_log_dir, ...)   (Pax's _create_checkpointer)
             checkpointer.get_model_states(partitioner, metadata, root_prng_key)
  each step  checkpointer.save_if_needed(step, state, unpadded shapes, pspecs, None)
             if --exit_after_ondemand_checkpoint and checkpointer.reached_preemption(step):
               checkpointer.close(); exit(1)
             stop when step >= num_train_steps, else train one step
  end        checkpointer.save_final(step, ...); checkpointer.close()

Run it under `orbax-mtc launch` (which sets the coordinator and each process's RAM folder):

  orbax-mtc launch --nprocs 2 --devices-per-process 1 --local-root /dev/shm/pax -- \\
    python -m pax_patch.example_executor --job_log_dir=/tmp/pax/run1 --num_train_steps=200 \\
    --jax_fully_async_checkpoint=1 --exit_after_ondemand_checkpoint=1 \\
    --mtc_local_save_interval_steps=5 --mtc_peers_per_node=1

The model is tiny: a Pax-like train state (`step`, `mdl_vars`, `opt_states`) sharded over a
("data", "model") mesh whose data axis spans the processes. Every value is a closed-form,
exactly representable function of the step (`global_state_numpy`), so a restored step is
checked bit for bit against a recomputation, and its digest against the one printed when it
was saved. Events are single `@@mtc KIND k=v ...` lines (tests/mp_worker.py's format):

  START process=0 step=7 tier=local match=1 digest=...   after get_model_states
  READY process=0 step=1                                   once per run, after a first step
  ONDEMAND process=0 step=9 digest=... persistent=1        save_if_needed saved on demand
  EXIT process=0 step=9 status=1                           Pax's exit after the on-demand save
  DONE process=0 step=200 digest=...                       after save_final and close
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

MARK = "@@mtc"

# Leaf path -> (dtype, PartitionSpec axes, global shape from (data, model) sizes).
LEAVES: dict[str, tuple[str, tuple, Any]] = {
    "mdl_vars/w": ("float32", ("data", "model"), lambda d, m: (8 * d, 16 * m)),
    "mdl_vars/b": ("bfloat16", ("model",), lambda d, m: (16 * m,)),
    "opt_states/mu": ("float32", (None, "model"), lambda d, m: (4, 8 * m)),
    "opt_states/count": ("int32", (), lambda d, m: ()),
    "step": ("int32", (), lambda d, m: ()),
}


def _out(line: str) -> None:
  """One event line in one write(2), so C++ log lines cannot split it."""
  data = f"{MARK} {line}\n".encode()
  while data:
    data = data[os.write(1, data):]


def _set(tree: dict, path: str, value: Any) -> None:
  *parents, last = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[last] = value


def _get(tree: Any, path: str) -> Any:
  for p in path.split("/"):
    tree = tree[p]
  return tree


def leaf_numpy(path: str, shape: tuple[int, ...], step: int, seed: int = 0) -> np.ndarray:
  """The whole leaf at `step`: what `train_step` computes, in closed form and exact.

  Args:
    path: The leaf's path, a key of `LEAVES`.
    shape: The leaf's global shape.
    step: The step.
    seed: Varies the initial values.

  Returns:
    The leaf as a numpy array of its dtype.

  Raises:
    AssertionError: If `path` is not a leaf of `LEAVES`.
  """
  import ml_dtypes

  if path in ("step", "opt_states/count"):
    return np.asarray(step, dtype=np.int32)
  size = int(np.prod(shape)) if shape else 1
  ints = (np.arange(size, dtype=np.int64) * 2654435761 + seed * 97 + len(path)) % 128 - 64
  ints = ints.reshape(shape)
  if path == "mdl_vars/w":  # w0 = k/8, then +1/8 per step: exact below 2**21
    return ((ints / 8.0) + step * 0.125).astype(np.float32)
  if path == "mdl_vars/b":  # bf16, sign flips every step: exact
    return ((ints / 16.0) * (-1.0) ** step).astype(ml_dtypes.bfloat16)
  if path == "opt_states/mu":  # mu -> 1 - mu: exact for k/4
    base = ints / 4.0
    return (base if step % 2 == 0 else 1.0 - base).astype(np.float32)
  raise AssertionError(path)


def global_state_numpy(step: int, data: int, model: int = 1, seed: int = 0) -> dict:
  """The train state at `step` as nested dicts of numpy arrays (any reader's expectation).

  Args:
    step: The step.
    data: Size of the mesh's "data" axis.
    model: Size of the mesh's "model" axis.
    seed: Varies the initial values.

  Returns:
    Nested dicts keyed by the parts of the `LEAVES` paths.
  """
  out: dict[str, Any] = {}
  for path, (_, _, shape_fn) in LEAVES.items():
    _set(out, path, leaf_numpy(path, shape_fn(data, model), step, seed))
  return out


@dataclasses.dataclass
class TrainStateMetadata:
  """What Pax's partitioner reports about the train state (trainer_lib.TrainStateMetadata).

  Attributes:
    padded_global_shapes: `jax.ShapeDtypeStruct` of every leaf, as stored.
    unpadded_global_shapes: `jax.ShapeDtypeStruct` of every leaf, unpadded (here the same).
    partition_specs: `PartitionSpec` of every leaf.
  """

  padded_global_shapes: Any
  unpadded_global_shapes: Any
  partition_specs: Any


class ExamplePartitioner:
  """The parts of Pax's partitioner the checkpointer and the loop use.

  Args:
    global_mesh: The ("data", "model") mesh.
    seed: Varies the initial values.

  Attributes:
    global_mesh: The ("data", "model") mesh.
    seed: Varies the initial values.
  """

  def __init__(self, global_mesh, seed: int = 0):
    self.global_mesh = global_mesh
    self.seed = seed

  def _dims(self) -> tuple[int, int]:
    return self.global_mesh.shape["data"], self.global_mesh.shape["model"]

  def get_train_state_metadata(self) -> TrainStateMetadata:
    """The shapes, dtypes and partition specs of every leaf of `LEAVES` on this mesh."""
    import jax
    from jax.sharding import PartitionSpec

    data, model = self._dims()
    shapes: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    for path, (dtype, axes, shape_fn) in LEAVES.items():
      _set(shapes, path, jax.ShapeDtypeStruct(shape_fn(data, model), dtype))
      _set(specs, path, PartitionSpec(*axes))
    return TrainStateMetadata(shapes, shapes, specs)

  def shardings(self) -> Any:
    """The `NamedSharding` of every leaf, as nested dicts."""
    import jax

    metadata = self.get_train_state_metadata()
    return jax.tree_util.tree_map(
        lambda spec: jax.sharding.NamedSharding(self.global_mesh, spec),
        metadata.partition_specs)

  def state_at(self, step: int) -> dict:
    """The train state at `step`, sharded, built from the closed form.

    Args:
      step: The step.

    Returns:
      Nested dicts of jax.Arrays sharded as `shardings()`.
    """
    import jax

    data, model = self._dims()
    shardings = self.shardings()
    out: dict[str, Any] = {}
    for path, (_, _, shape_fn) in LEAVES.items():
      shape = shape_fn(data, model)
      value = leaf_numpy(path, shape, step, self.seed)
      _set(out, path, jax.make_array_from_callback(
          shape, _get(shardings, path), lambda index, v=value: v[index]))
    return out

  def initialize_prng_key_and_train_state(self, root_prng_key, train_state, checkpoint_type):
    """As Pax: split the key; initialise the state when nothing was restored.

    Args:
      root_prng_key: The root PRNG key.
      train_state: The restored state, or None.
      checkpoint_type: Accepted and ignored.

    Returns:
      (the new root key, the train state, "initialized" if it was initialised else None).
    """
    import jax

    del checkpoint_type
    root_prng_key, _ = jax.random.split(root_prng_key)
    provenance = None
    if train_state is None:
      train_state = self.state_at(0)
      provenance = "initialized"
    return root_prng_key, train_state, provenance


def make_train_step(partitioner: ExamplePartitioner):
  """One jitted step; exactly `global_state_numpy(step + 1)` from `global_state_numpy(step)`.

  Args:
    partitioner: Gives the state's shardings.

  Returns:
    The jitted function from one state to the next.
  """
  import jax
  import jax.numpy as jnp

  shardings = partitioner.shardings()

  def step_fn(state):
    mdl, opt = state["mdl_vars"], state["opt_states"]
    return {
        "mdl_vars": {"w": mdl["w"] + jnp.float32(0.125), "b": -mdl["b"]},
        "opt_states": {"mu": jnp.float32(1.0) - opt["mu"], "count": opt["count"] + 1},
        "step": state["step"] + 1,
    }

  return jax.jit(step_fn, in_shardings=(shardings,), out_shardings=shardings)


def digest(state: Any) -> str:
  """Hashes this process's shards: leaf, index and bytes.

  Args:
    state: A pytree of jax.Arrays.

  Returns:
    The first 16 hex digits of the SHA-256.
  """
  import jax

  h = hashlib.sha256()
  for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(state)[0],
                           key=lambda kv: jax.tree_util.keystr(kv[0])):
    h.update(jax.tree_util.keystr(path).encode())
    for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
      h.update(repr(shard.index).encode())
      h.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
  return h.hexdigest()[:16]


def matches(state: Any, expected: Any) -> bool:
  """Bit-exact equality of this process's shards (same dtype, shape, sharding).

  Args:
    state: The state to check (nested dicts with the `LEAVES` paths).
    expected: The state it should equal.

  Returns:
    True if every leaf of `LEAVES` has the same dtype, shape, sharding and shard bytes.
  """
  for path in LEAVES:
    got, want = _get(state, path), _get(expected, path)
    if (got.dtype, got.shape, got.sharding) != (want.dtype, want.shape, want.sharding):
      return False
    wanted = {s.device: s for s in want.addressable_shards}
    for shard in got.addressable_shards:
      other = wanted.get(shard.device)
      if other is None or shard.index != other.index:
        return False
      if np.asarray(shard.data).tobytes() != np.asarray(other.data).tobytes():
        return False
  return True


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--job_log_dir", required=True)
  p.add_argument("--num_train_steps", type=int, required=True)
  p.add_argument("--save_interval_steps", type=int, default=1000,
                 help="Pax's task.train.save_interval_steps: the persistent tier")
  p.add_argument("--save_max_to_keep", type=int, default=None)
  p.add_argument("--step_ms", type=float, default=0.0,
                 help="pad each step to this long (stands for device time)")
  p.add_argument("--seed", type=int, default=0)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the executor: set-up and restore, the training loop, the final save.

  Args:
    argv: Pax's flags, `--mtc_*` flags and this example's (`--job_log_dir`,
      `--num_train_steps`, ...), without the program name; None reads `sys.argv[1:]`.

  Returns:
    0 when training finished; `PAX_ONDEMAND_EXIT_STATUS` (1) after an on-demand save with
    `--exit_after_ondemand_checkpoint`; `USAGE_EXIT_STATUS` (2) for a bad `--mtc_*` flag.

  Raises:
    AssertionError: If the restored state's step is not the checkpointer's `step_to_restore`.
  """
  from pax_patch import main as pax_main

  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    flags = pax_main.parse_flags(argv)
  except pax_main.FlagError as e:
    print(f"example_executor: error: {e}", file=sys.stderr)
    return pax_main.USAGE_EXIT_STATUS
  # Pax's two flags were read by parse_flags; the rest stand for the experiment config.
  args = _parser().parse_args(
      [t for t in flags.pax_argv if (pax_main._split(t) or ("",))[0].removeprefix("no")
       not in pax_main.PAX_BOOL_FLAGS])

  from orbax_mtc import distributed

  if flags.jax_fully_async_checkpoint:
    distributed.initialize()  # what the flag makes Pax's setup_jax do

  import jax
  import numpy as np

  from pax_patch import checkpointer as pax_checkpointer

  me = jax.process_index()
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)),
                     dtype=object).reshape(jax.process_count(), -1)
  mesh = jax.sharding.Mesh(devices, ("data", "model"))
  task_p = types.SimpleNamespace(
      model=types.SimpleNamespace(ici_mesh_shape=list(devices.shape)),
      train=types.SimpleNamespace(
          num_train_steps=args.num_train_steps, save_interval_steps=args.save_interval_steps,
          save_max_to_keep=args.save_max_to_keep, save_keep_interval_duration=None,
          enable_input_checkpointing=False, restore_transformations=None))
  checkpointer = pax_checkpointer.create_checkpointer(
      task_p, args.job_log_dir, "GDA", None,
      enable_async_checkpointing=flags.jax_fully_async_checkpoint, config=flags.config())

  partitioner = ExamplePartitioner(mesh, seed=args.seed)
  metadata = partitioner.get_train_state_metadata()
  state, _, _, _ = checkpointer.get_model_states(partitioner, metadata,
                                                 jax.random.PRNGKey(args.seed))
  step_i = int(state["step"])
  if checkpointer.step_to_restore is not None and checkpointer.step_to_restore != step_i:
    raise AssertionError(f"checkpoint {checkpointer.step_to_restore} restored step {step_i}")
  info = checkpointer.last_restore
  expected = partitioner.state_at(step_i)
  _out(f"START process={me} step={step_i} tier={info.tier if info else 'none'} "
       f"match={int(matches(state, expected))} digest={digest(state)}")

  train_step = make_train_step(partitioner)
  seen_ondemand = None
  ready = False
  while True:
    started = time.monotonic()
    checkpointer.save_if_needed(step_i, state, metadata.unpadded_global_shapes,
                                metadata.partition_specs, None)
    ondemand = checkpointer.last_ondemand
    if ondemand is not None and ondemand.step != seen_ondemand:
      seen_ondemand = ondemand.step
      _out(f"ONDEMAND process={me} step={ondemand.step} digest={digest(state)} "
           f"persistent={int(ondemand.persistent)}")
    if flags.exit_after_ondemand_checkpoint and checkpointer.reached_preemption(step_i):
      _out(f"EXIT process={me} step={step_i} status={pax_checkpointer.PAX_ONDEMAND_EXIT_STATUS}")
      checkpointer.close()
      return pax_checkpointer.PAX_ONDEMAND_EXIT_STATUS
    if step_i >= args.num_train_steps:
      break
    state = train_step(state)
    step_i = int(state["step"])
    if not ready:
      ready = True
      _out(f"READY process={me} step={step_i}")
    # Pads the step to the wanted length: stands for device time, not a synchronisation.
    left = args.step_ms / 1000 - (time.monotonic() - started)
    if left > 0:
      time.sleep(left)

  checkpointer.save_final(step_i, partitioned_train_state=state,
                          train_state_unpadded_shape_dtype_struct=metadata.unpadded_global_shapes,
                          train_state_pspecs=metadata.partition_specs)
  checkpointer.close()
  _out(f"DONE process={me} step={step_i} digest={digest(state)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
