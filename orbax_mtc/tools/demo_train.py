"""The demo's training job: a small MLP with Adam, sharded over a (data, model) mesh.

Run by `orbax-mtc demo` under the launcher (one copy per process). Each process writes a JSON
report of what it did (restore source, save blocking times, bytes per tier) for the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_mtc as mtc
from orbax_mtc.local import store as local_store

WIDTHS = (64, 512, 512, 16)
BATCH = 64


def param_specs() -> dict:
  specs = {}
  for i in range(len(WIDTHS) - 1):
    # Alternate column/row sharding over "model", Megatron style.
    specs[f"w{i}"] = P(None, "model") if i % 2 == 0 else P("model", None)
    specs[f"b{i}"] = P("model") if i % 2 == 0 else P()
  return specs


def init_state(seed: int = 0) -> dict:
  params = {}
  key = jax.random.PRNGKey(seed)
  for i, (n_in, n_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True)):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    params[f"b{i}"] = jnp.zeros((n_out,), jnp.float32)
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"params": params, "opt": {"mu": zeros, "nu": zeros}, "step": jnp.int32(0)}


def state_shardings(mesh: Mesh) -> dict:
  specs = param_specs()
  named = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  return {"params": named, "opt": {"mu": named, "nu": named},
          "step": NamedSharding(mesh, P())}


def batch(step: int, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
  """The global batch of a step, the same whichever process builds which part."""
  rng = np.random.default_rng(step)
  x = rng.standard_normal((BATCH, WIDTHS[0]), dtype=np.float32)
  y = np.tanh(x[:, : WIDTHS[-1]] * 2.0).astype(np.float32)
  sharding = NamedSharding(mesh, P("data"))
  return tuple(jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx])
               for a in (x, y))


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  h = x
  n = len(WIDTHS) - 1
  for i in range(n):
    h = h @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      h = jax.nn.gelu(h)
  return jnp.mean((h - y) ** 2)


def train_step(state: dict, x: jax.Array, y: jax.Array, lr: float = 1e-3) -> tuple[dict, jax.Array]:
  loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
  t = state["step"].astype(jnp.float32) + 1
  mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["opt"]["mu"], grads)
  nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["opt"]["nu"], grads)
  params = jax.tree.map(
      lambda p, m, v: p - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8),
      state["params"], mu, nu)
  return {"params": params, "opt": {"mu": mu, "nu": nu}, "step": state["step"] + 1}, loss


def _dir_bytes(path: Path) -> int:
  if not path.exists():
    return 0
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--persistent-dir", required=True)
  parser.add_argument("--report-dir", required=True)
  parser.add_argument("--phase", type=int, default=1)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--local-every", type=int, default=4)
  parser.add_argument("--persistent-every", type=int, default=20)
  parser.add_argument("--kill-rank", type=int, default=-1)
  parser.add_argument("--kill-at-step", type=int, default=-1)
  parser.add_argument("--sigterm-rank", type=int, default=-1)
  parser.add_argument("--sigterm-at-step", type=int, default=-1)
  args = parser.parse_args(argv)

  info = mtc.distributed.initialize()
  local_dir = info.local_directory or "/dev/shm/orbax-mtc-demo/node0"
  devices = np.array(jax.devices())
  mesh = Mesh(devices.reshape(2, -1) if devices.size % 2 == 0 else devices.reshape(1, -1),
              ("data", "model"))
  shardings = state_shardings(mesh)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          jax.eval_shape(init_state), shardings)
  step_fn = jax.jit(train_step, out_shardings=(shardings, NamedSharding(mesh, P())))
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=args.local_every, max_to_keep=2),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=args.persistent_every),
      replication=mtc.ReplicationOptions(replica_axis="data"),
      job_name="demo")
  report: dict = {"process": info.process_id, "phase": args.phase, "saves": [],
                  "blocking_s": []}
  with mtc.CheckpointManager(local_dir, args.persistent_dir, mesh, abstract,
                             options=options) as mgr:
    restored = mgr.restore(None)
    if restored is None:
      state = jax.jit(init_state, out_shardings=shardings)()
    else:
      state = restored.state
    first = int(state["step"])
    report["restore"] = dict(step=mgr.last_restore.step, tier=mgr.last_restore.tier,
                             seconds=mgr.last_restore.seconds)
    loss = None
    for step in range(first + 1, args.steps + 1):
      if info.process_id == args.sigterm_rank and step == args.sigterm_at_step:
        # A maintenance notice: the other processes learn of it through JAX.
        print(f"demo: process {info.process_id} gets SIGTERM at step {step}", flush=True)
        report["sigterm_sent_at"] = time.time()
        os.kill(os.getpid(), signal.SIGTERM)
      x, y = batch(step, mesh)
      state, loss = step_fn(state, x, y)
      jax.block_until_ready(state)  # time the save, not the step still being computed
      save_started = time.perf_counter()
      if mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state))):
        report["saves"].append(step)
        report["blocking_s"].append(time.perf_counter() - save_started)
      report["last_step"] = step
      if mgr.should_exit():  # the on-demand checkpoint of a preemption is durable
        report["ondemand"] = dataclasses.asdict(mgr.last_ondemand)
        report["ondemand_durable_at"] = time.time()
        print(f"demo: process {info.process_id} stops after the on-demand checkpoint of step "
              f"{step}", flush=True)
        break
      if step == args.kill_at_step:
        # Every process at the same point: waiting is an agreement (errors anywhere raise
        # everywhere), so one process alone would wait there for the others.
        mgr.wait_until_finished()
      if info.process_id == args.kill_rank and step == args.kill_at_step:
        _write_report(args, info.process_id, report, mgr)
        print(f"demo: process {info.process_id} kills itself with SIGKILL at step {step}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      if step % 10 == 0:
        print(f"step {step} loss {float(loss):.5f}", flush=True)
    mgr.wait_until_finished()
    report["final_loss"] = None if loss is None else float(loss)
    _write_report(args, info.process_id, report, mgr)
  return 0


def _write_report(args, process_id: int, report: dict, mgr: mtc.CheckpointManager) -> None:
  report["local_bytes"] = _dir_bytes(Path(mgr.local_directory))
  report["persistent_bytes"] = _dir_bytes(Path(str(mgr.directory)))
  report["local_steps"] = local_store.committed_steps(Path(mgr.local_directory))
  if report["blocking_s"]:
    report["blocking_median_s"] = statistics.median(report["blocking_s"])
  report["time"] = time.time()
  out = Path(args.report_dir) / f"phase{args.phase}-node{process_id}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report))


if __name__ == "__main__":
  sys.exit(main())
