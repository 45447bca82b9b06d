"""A MaxText-shaped training loop on `maxtext_patch.checkpointing` (our own code; no MaxText).

  python -m orbax_mtc launch --nprocs 2 --devices-per-process 2 --local-root /dev/shm/mt -- \\
    python -m maxtext_patch.example_train run_name=demo base_output_directory=/tmp/mt \\
      steps=200 enable_emergency_checkpoint=true local_checkpoint_period=10 \\
      local_checkpoint_directory=/dev/shm/mt/node{process_index} checkpoint_period=100 \\
      enable_autocheckpoint=true ici_fsdp_parallelism=-1

As MaxText's train loop: a config with MaxText's key names (defaults, then an optional YAML file,
then `key=value` arguments; unknown keys are errors), a ("data", "fsdp") mesh from
`ici_data_parallelism`/`ici_fsdp_parallelism`, `create_checkpoint_manager`,
`load_state_if_possible`, then per step one train step and `maybe_save_checkpoint`, a final
save, and `StopTraining` ending the loop at the step every process agreed on after a SIGTERM.
The model is a small decoder-only transformer trained with Adam; data and initial weights are
pure functions of (seed, step), so a restored run recomputes what an uninterrupted one did.

One event line per step and outcome (`@@mtc KIND k=v ...`, read by the tests):
  RESTORED process=0 step=6 tier=local digest=...   (step=-1 tier=none: initial state)
  STEP process=0 step=7 loss=... digest=...         (digest: this process's shards, bit exact)
  HOLDING process=0 step=6                          (example_hold_at_step: saved everywhere)
  STOPPED process=0 step=9 ondemand=9 detail=...    (StopTraining; ondemand: the agreed step)
  DONE process=0 step=19
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_mtc as mtc
from maxtext_patch import checkpointing
from maxtext_patch import config as mtc_config

MARK = "@@mtc"
_SKIP_MAXTEXT_KEYS = ("checkpoint_dir", "enable_single_controller",
                      "colocated_python_checkpointing")

# MaxText key names and defaults; then the model's; then orbax-mtc's; then this example's.
DEFAULTS: dict[str, Any] = {
    "run_name": "example",
    "base_output_directory": "",
    "steps": 20,
    "save_checkpoint_on_completion": True,
    **{k: v for k, v in mtc_config.MAXTEXT_DEFAULTS.items() if k not in _SKIP_MAXTEXT_KEYS},
    "ici_data_parallelism": 1,
    "ici_fsdp_parallelism": -1,
    "base_emb_dim": 32,
    "base_mlp_dim": 64,
    "base_num_decoder_layers": 2,
    "vocab_size": 64,
    "max_target_length": 16,
    "per_device_batch_size": 2,
    "learning_rate": 3e-3,
    "init_weights_seed": 0,
    **mtc_config.NEW_KEYS,
    # This example's own: after this step's save is complete on every process, print HOLDING
    # and wait (tests SIGKILL the job there); -1: never.
    "example_hold_at_step": -1,
    "example_hold_seconds": 120.0,
}


def _parse(key: str, text: str) -> Any:
  default = DEFAULTS[key]
  try:
    if isinstance(default, bool):
      return mtc_config.as_bool(key, text)
    if isinstance(default, int):
      return int(text.replace("_", ""))
    if isinstance(default, float):
      return float(text)
    if isinstance(default, str):
      return text
    return yaml.safe_load(text) if text.strip() else None
  except ValueError as e:
    raise ValueError(f"{key}={text!r}: expected a value like {default!r} ({e}).") from None


class Config:
  """Read-only attribute access to the keys, as MaxText's `HyperParameters`.

  `checkpoint_dir` is derived as MaxText does: <base_output_directory>/<run_name>/checkpoints
  (empty without a base directory).

  Args:
    keys: Key -> value, over `DEFAULTS`.

  Raises:
    ValueError: If a key is not in `DEFAULTS`.
  """

  def __init__(self, keys: dict[str, Any]):
    unknown = sorted(set(keys) - set(DEFAULTS))
    if unknown:
      raise ValueError(f"Unknown config key(s) {unknown}; known: {sorted(DEFAULTS)}.")
    values = {**DEFAULTS, **keys}
    base = values["base_output_directory"]
    # MaxText puts a run's checkpoints under <base_output_directory>/<run_name>/checkpoints.
    values["checkpoint_dir"] = os.path.join(base, values["run_name"], "checkpoints") \
        if base else ""
    object.__setattr__(self, "_keys", values)

  @classmethod
  def from_argv(cls, argv: Sequence[str]) -> Config:
    """Builds a config from `[config.yml] key=value ...`, as MaxText's command line.

    Args:
      argv: An optional YAML file first, then `key=value` overrides.

    Returns:
      The `Config`.

    Raises:
      ValueError: If an argument is not `key=value`, a key is unknown, or a value does not
        parse as the type of its default.
    """
    keys: dict[str, Any] = {}
    args = list(argv)
    if args and "=" not in args[0]:
      with open(args.pop(0)) as f:
        keys.update(yaml.safe_load(f) or {})
    for arg in args:
      key, sep, value = arg.partition("=")
      if not sep:
        raise ValueError(f"Arguments are key=value, got {arg!r}.")
      if key not in DEFAULTS:
        raise ValueError(f"Unknown config key {key!r}; known: {sorted(DEFAULTS)}.")
      keys[key] = _parse(key, value)
    return cls(keys)

  def __getattr__(self, key: str) -> Any:
    try:
      return self._keys[key]
    except KeyError:
      raise AttributeError(key) from None

  def __setattr__(self, key: str, value: Any) -> None:
    """Refuses every assignment.

    Raises:
      ValueError: Always: the config is read-only.
    """
    raise ValueError("The config is read-only.")

  def get_keys(self) -> dict[str, Any]:
    """Every key and its value (a copy), as MaxText's `HyperParameters.get_keys`."""
    return dict(self._keys)


# ----------------------------------------------------------------------------- model


class AdamState(NamedTuple):
  """Adam's optimizer state.

  Attributes:
    count: Number of updates so far.
    mu: First moments, shaped like the params.
    nu: Second moments, shaped like the params.
  """

  count: jax.Array
  mu: dict
  nu: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Shaped as Flax's Linen `TrainState` (step, params, opt_state) as MaxText trains it.

  Attributes:
    step: Number of training steps taken.
    params: The model's parameters.
    opt_state: Adam's state.
  """

  step: jax.Array
  params: dict
  opt_state: AdamState


def make_mesh(cfg: Config) -> Mesh:
  """The ("data", "fsdp") mesh of every device, as MaxText's ici_* parallelism keys ask.

  Args:
    cfg: The config; `ici_data_parallelism` / `ici_fsdp_parallelism` (one may be -1: the rest).

  Returns:
    The mesh.

  Raises:
    ValueError: If both are -1 or their product is not the number of devices.
  """
  devices = np.array(jax.devices())
  data, fsdp = cfg.ici_data_parallelism, cfg.ici_fsdp_parallelism
  if data == -1 and fsdp == -1:
    raise ValueError("At most one of ici_data_parallelism and ici_fsdp_parallelism can be -1.")
  if data == -1:
    data = devices.size // fsdp
  if fsdp == -1:
    fsdp = devices.size // data
  if data * fsdp != devices.size:
    raise ValueError(f"ici_data_parallelism x ici_fsdp_parallelism = {data} x {fsdp} must "
                     f"equal the {devices.size} devices.")
  return Mesh(devices.reshape(data, fsdp), ("data", "fsdp"))


def param_specs(cfg: Config) -> dict:
  """The `PartitionSpec` of every parameter: weights sharded over "fsdp", norms replicated.

  Args:
    cfg: The config.

  Returns:
    A pytree of specs shaped like the params.
  """
  weight = P("fsdp", None)
  layer = {"attn_norm": P(), "wq": weight, "wk": weight, "wv": weight, "wo": weight,
           "mlp_norm": P(), "wi": weight, "wo_mlp": weight}
  return {"embed": weight, "final_norm": P(),
          "layers": {f"layer_{i}": dict(layer) for i in range(cfg.base_num_decoder_layers)}}


def state_shardings(cfg: Config, mesh: Mesh) -> TrainState:
  """The sharding of every leaf of the train state.

  Args:
    cfg: The config.
    mesh: The mesh from `make_mesh`.

  Returns:
    A `TrainState` of `NamedSharding`s.
  """
  params = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg),
                        is_leaf=lambda x: isinstance(x, P))
  return TrainState(step=NamedSharding(mesh, P()), params=params,
                    opt_state=AdamState(NamedSharding(mesh, P()), params, params))


def init_state(cfg: Config) -> TrainState:
  """The initial train state, a pure function of `init_weights_seed`.

  Args:
    cfg: The config.

  Returns:
    The state at step 0 with zero Adam moments.
  """
  emb, mlp, vocab = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.vocab_size
  keys = iter(jax.random.split(jax.random.PRNGKey(cfg.init_weights_seed), 64))

  def dense(n_in: int, n_out: int) -> jax.Array:
    return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / np.sqrt(n_in)

  layers = {}
  for i in range(cfg.base_num_decoder_layers):
    layers[f"layer_{i}"] = {
        "attn_norm": jnp.ones((emb,)), "wq": dense(emb, emb), "wk": dense(emb, emb),
        "wv": dense(emb, emb), "wo": dense(emb, emb), "mlp_norm": jnp.ones((emb,)),
        "wi": dense(emb, mlp), "wo_mlp": dense(mlp, emb)}
  params = {"embed": dense(vocab, emb), "final_norm": jnp.ones((emb,)), "layers": layers}
  zeros = jax.tree.map(jnp.zeros_like, params)
  return TrainState(step=jnp.int32(0), params=params,
                    opt_state=AdamState(jnp.int32(0), zeros, zeros))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of the decoder-only transformer.

  Args:
    params: The model's parameters.
    tokens: int32 tokens shaped (batch, length + 1).

  Returns:
    The mean loss, a scalar.
  """
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  x = params["embed"][inputs]
  length = inputs.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  for layer in params["layers"].values():
    h = _rms_norm(x, layer["attn_norm"])
    q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    scores = jnp.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]), -1e9)
    x = x + (jax.nn.softmax(scores, axis=-1) @ v) @ layer["wo"]
    h = _rms_norm(x, layer["mlp_norm"])
    x = x + jax.nn.gelu(h @ layer["wi"]) @ layer["wo_mlp"]
  logits = _rms_norm(x, params["final_norm"]) @ params["embed"].T
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def train_step(state: TrainState, tokens: jax.Array, lr: float) -> tuple[TrainState, jax.Array]:
  """One Adam step.

  Args:
    state: The train state.
    tokens: The batch (see `batch`).
    lr: The learning rate.

  Returns:
    (the next state, the loss before the step).
  """
  loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens)
  count = state.opt_state.count + 1
  mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state.opt_state.mu, grads)
  nu = jax.tree.map(lambda n, g: 0.999 * n + 0.001 * g * g, state.opt_state.nu, grads)
  t = count.astype(jnp.float32)
  params = jax.tree.map(
      lambda p, m, n: p - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(n / (1 - 0.999**t)) + 1e-8),
      state.params, mu, nu)
  return TrainState(step=state.step + 1, params=params,
                    opt_state=AdamState(count, mu, nu)), loss


def batch(cfg: Config, mesh: Mesh, step: int) -> jax.Array:
  """The global batch of `step` (a learnable token recurrence), whichever process builds it.

  Args:
    cfg: The config.
    mesh: The mesh; the batch is sharded over ("data", "fsdp").
    step: The step.

  Returns:
    int32 tokens shaped (per_device_batch_size x devices, max_target_length + 1).
  """
  size = cfg.per_device_batch_size * mesh.devices.size
  rng = np.random.default_rng([cfg.init_weights_seed, step])
  tokens = np.empty((size, cfg.max_target_length + 1), np.int32)
  tokens[:, 0] = rng.integers(0, cfg.vocab_size, size)
  for t in range(cfg.max_target_length):
    tokens[:, t + 1] = (tokens[:, t] * 5 + 3) % cfg.vocab_size
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  return jax.make_array_from_callback(tokens.shape, sharding, lambda idx: tokens[idx])


def digest(state: Any) -> str:
  """Hashes this process's shards of every leaf, bit for bit.

  Args:
    state: A pytree of jax.Arrays.

  Returns:
    The first 16 hex digits of the SHA-256.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
      h.update(f"{jax.tree_util.keystr(path)}{shard.index}".encode())
      h.update(np.asarray(shard.data).tobytes())
  return h.hexdigest()[:16]


def emit(line: str) -> None:
  """Writes one event line to stdout in one write(2), so that no other output lands inside it.

  Args:
    line: The event, without the `@@mtc` mark and newline.
  """
  data = f"{MARK} {line}\n".encode()
  while data:
    data = data[os.write(1, data):]


# ----------------------------------------------------------------------------- loop


def _hold(cfg: Config, manager: Any, me: int, step: int) -> None:
  checkpointing.wait_until_finished(manager)  # the step is in RAM and at its peers everywhere
  emit(f"HOLDING process={me} step={step}")
  threading.Event().wait(cfg.example_hold_seconds)  # the test SIGKILLs the job meanwhile
  emit(f"ERROR process={me} step={step} detail=still holding after "
       f"{cfg.example_hold_seconds} s")
  sys.exit(3)


def train_loop(cfg: Config) -> int:
  """Restores or initialises, trains to `cfg.steps` saving as MaxText does, emitting events.

  Stops early, cleanly, at the agreed preemption step (`StopTraining`).

  Args:
    cfg: The config.

  Returns:
    0.
  """
  me = jax.process_index()
  mesh = make_mesh(cfg)
  shardings = state_shardings(cfg, mesh)
  init_state_fn = jax.jit(functools.partial(init_state, cfg), out_shardings=shardings)
  manager = checkpointing.create_checkpoint_manager(cfg, mesh, init_state_fn)
  restored, _ = checkpointing.load_state_if_possible(
      manager, None, "", "", 96, jax.eval_shape(init_state_fn), maxtext_config=cfg)
  if restored is not None:
    state = restored
    tier = manager.last_restore.tier if checkpointing.is_multi_tier(manager) else "persistent"
  else:
    state, tier = init_state_fn(), "none"
  step = int(state.step)  # the first step to run (MaxText's get_first_step)
  emit(f"RESTORED process={me} step={step - 1} tier={tier} digest={digest(state)}")
  step_fn = jax.jit(functools.partial(train_step, lr=cfg.learning_rate),
                    out_shardings=(shardings, NamedSharding(mesh, P())))
  try:
    while step < cfg.steps:
      state, loss = step_fn(state, batch(cfg, mesh, step))
      emit(f"STEP process={me} step={step} loss={float(loss):.6f} digest={digest(state)}")
      checkpointing.maybe_save_checkpoint(manager, state, cfg, None, step)
      if step == cfg.example_hold_at_step:
        _hold(cfg, manager, me, step)
      step += 1
    if cfg.save_checkpoint_on_completion:
      checkpointing.maybe_save_checkpoint(manager, state, cfg, None)
    if manager is not None:
      checkpointing.wait_until_finished(manager)
    emit(f"DONE process={me} step={step - 1}")
  except checkpointing.StopTraining as e:
    ondemand = getattr(manager, "last_ondemand", None)
    emit(f"STOPPED process={me} step={step} ondemand={ondemand.step if ondemand else -1} "
         f"detail={e}")
  finally:
    if manager is not None:
      manager.close()  # MaxText leaves this to process exit; closing is tidier
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Joins `jax.distributed`, reads the config and runs `train_loop`.

  Args:
    argv: `[config.yml] key=value ...`; None reads `sys.argv[1:]`.

  Returns:
    The exit status, 0.

  Raises:
    ValueError: If the config arguments are malformed.
  """
  # Before any JAX computation, as MaxText's config does (maybe_initialize_jax_distributed_system).
  mtc.distributed.initialize()
  cfg = Config.from_argv(sys.argv[1:] if argv is None else argv)
  return train_loop(cfg)


if __name__ == "__main__":
  sys.exit(main())
