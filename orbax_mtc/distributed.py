"""Joining `jax.distributed`, from our launcher's environment or a real cluster's.

`orbax-mtc launch` (`orbax_mtc.tools.launch`) starts N local processes, each playing one host,
and tells each who it is through the `ORBAX_MTC_*` variables below. On a real cluster (Cloud TPU
pod, SLURM, Open MPI, Kubernetes) those are absent and JAX's own cluster detection finds the
coordinator. With neither, the job runs as a single process without `jax.distributed`, which the
checkpoint manager supports (RAM tier + persistent tier, SIGTERM through our own handler).

`initialize()` must run before anything that starts a JAX backend (`jax.devices()`, any
computation), as `jax.distributed.initialize` requires.

Leaving the job. JAX dispatches computations asynchronously, and a program may end while a
collective it no longer waits for is still running: `multihost_utils.process_allgather` returns
as soon as the first local device has its copy, while on the other local devices the same
all-gather is still setting up its gloo connection (through the coordination service's key-value
store) or exchanging data with the other processes. JAX's exit hook then runs
`jax.distributed.shutdown()`: its barrier lets process 0 stop the coordination service, and a
process whose collective still needed the service or a peer that has now left blocks for good in
the CPU client's destructor, which joins the thread running that collective. So `initialize()`
and `join()` also register an exit hook that runs before JAX's (atexit runs hooks in reverse
order): every process meets at a bounded barrier and then runs one small collective on every
device and waits for all of it. XLA launches collective programs one after another, so when that
last one is done everywhere, no earlier one is still in flight anywhere, and the shutdown that
follows strands nothing.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import sys

import jax
from absl import logging

__all__ = [
    "ORBAX_MTC_COORDINATOR",
    "ORBAX_MTC_LOCAL_DIR",
    "ORBAX_MTC_NUM_PROCESSES",
    "ORBAX_MTC_PROCESS_ID",
    "ORBAX_MTC_WORKER_INDEX",
    "DistributedInfo",
    "detected_cluster",
    "finish_collectives",
    "initialize",
    "is_initialized",
    "local_directory",
    "worker_index",
]

# Environment contract between `orbax_mtc.tools.launch` and its children.
ORBAX_MTC_COORDINATOR = "ORBAX_MTC_COORDINATOR"  # "127.0.0.1:PORT"
ORBAX_MTC_NUM_PROCESSES = "ORBAX_MTC_NUM_PROCESSES"
ORBAX_MTC_PROCESS_ID = "ORBAX_MTC_PROCESS_ID"
ORBAX_MTC_LOCAL_DIR = "ORBAX_MTC_LOCAL_DIR"  # this process's own RAM-disk folder
ORBAX_MTC_WORKER_INDEX = "ORBAX_MTC_WORKER_INDEX"  # index of the process inside its host

_LAUNCHER_VARS = (ORBAX_MTC_COORDINATOR, ORBAX_MTC_NUM_PROCESSES, ORBAX_MTC_PROCESS_ID)

# The exit barrier: how long a process waits at exit for the others to reach theirs. Processes of
# one SPMD program end together; one that does not arrive is still running (or failed), and then
# the in-flight collectives cannot be waited for anyway. A process leaving on an uncaught
# exception waits less: the others are usually not leaving, and JAX's own shutdown barrier will
# hold it again (up to `shutdown_timeout_seconds`) before the launcher can see it fail.
# A process that stops sending heartbeats (killed, its host gone) is declared dead after this
# many seconds, and every other process then ends with an error naming it. JAX's own default
# is 100 s, all of it goodput lost at each failure, since the scheduler restarts a job once
# every process has ended; heartbeats come from a thread of their own, so load does not delay
# them. ORBAX_MTC_HEARTBEAT_TIMEOUT_S (or `initialize(heartbeat_timeout_s=...)`) overrides it.
HEARTBEAT_TIMEOUT_S = 30
ORBAX_MTC_HEARTBEAT_TIMEOUT_S = "ORBAX_MTC_HEARTBEAT_TIMEOUT_S"
EXIT_BARRIER_TIMEOUT_S = 60.0
EXIT_BARRIER_TIMEOUT_ON_ERROR_S = 10.0
_EXIT_KEY = "orbax_mtc_exit"
# Numbers the calls of `finish_collectives` (alike on every process) so none reuses a key.
_finish_calls = itertools.count()
_exit_hook_registered = False


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """Who this process is in the job.

  Attributes:
    process_id: Rank of this process.
    num_processes: Number of processes in the job.
    coordinator: Address of the coordinator; None when running single-process (no
      `jax.distributed`).
    local_directory: This process's RAM-disk folder from `ORBAX_MTC_LOCAL_DIR`, or None.
    worker_index: Index of this process inside its host (see `worker_index`).
  """

  process_id: int
  num_processes: int
  coordinator: str | None
  local_directory: str | None
  worker_index: int


def _env_int(name: str, *, minimum: int) -> int | None:
  """Reads an integer variable; None when unset or empty."""
  raw = os.environ.get(name, "").strip()
  if not raw:
    return None
  try:
    value = int(raw)
  except ValueError:
    raise ValueError(f"{name}={raw!r} is not an integer.") from None
  if value < minimum:
    raise ValueError(f"{name}={value} must be >= {minimum}.")
  return value


def is_initialized() -> bool:
  """Whether `jax.distributed` has been initialised in this process.

  Returns:
    True if this process has joined `jax.distributed`.
  """
  fn = getattr(jax.distributed, "is_initialized", None)
  if fn is not None:
    return bool(fn())
  # Older JAX without the public helper: the same check it makes.
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state.client is not None


def worker_index() -> int:
  """Index of this process inside its host.

  ORBAX_MTC_WORKER_INDEX, else TPU_WORKER_ID (Cloud TPU), else LOCAL_RANK (torchrun-style GPU
  launchers), else 0.

  Returns:
    The index, >= 0.

  Raises:
    ValueError: If the first of those variables that is set is not an integer >= 0.
  """
  for name in (ORBAX_MTC_WORKER_INDEX, "TPU_WORKER_ID", "LOCAL_RANK"):
    value = _env_int(name, minimum=0)
    if value is not None:
      return value
  return 0


def local_directory(default: str | None = None) -> str | None:
  """This process's RAM-disk folder as set by the launcher.

  Args:
    default: What to return when `ORBAX_MTC_LOCAL_DIR` is unset or empty.

  Returns:
    The value of `ORBAX_MTC_LOCAL_DIR`, else `default`.
  """
  return os.environ.get(ORBAX_MTC_LOCAL_DIR) or default


def detected_cluster() -> str | None:
  """Name of the cluster environment JAX's auto-detection would use, or None.

  Asks every registered `jax._src.clusters.ClusterEnv` (Cloud TPU on GCE/GKE, SLURM, Open MPI,
  Kubernetes) whether it is present, skipping opt-in-only ones (mpi4py), which is the same
  selection `jax.distributed.initialize()` makes with no arguments. JAX has no public API for
  this question; the `ClusterEnv` registry has been stable since JAX 0.4. A probe that raises
  counts as absent (with a warning).

  Returns:
    The class name of the first cluster environment present, or None.
  """
  try:
    from jax._src import clusters
  except ImportError:  # pragma: no cover - layout changed in a future JAX
    logging.warning("jax._src.clusters not found; assuming no cluster environment.")
    return None
  for env in clusters.ClusterEnv._cluster_types:
    if getattr(env, "opt_in_only_method", False):
      continue
    try:
      present = env.is_env_present()
    except Exception as e:  # a broken probe must not stop a single-process run
      logging.warning("Cluster probe %s failed: %s", env.__name__, e)
      present = False
    if present:
      return env.__name__
  return None


def _current_info() -> DistributedInfo:
  """Info for an already-initialised `jax.distributed`, without starting a backend."""
  from jax._src import distributed as jax_distributed

  state = jax_distributed.global_state
  return DistributedInfo(
      process_id=int(state.process_id),
      num_processes=int(state.num_processes),
      coordinator=state.coordinator_address,
      local_directory=local_directory(),
      worker_index=worker_index(),
  )


def _launcher_params() -> tuple[str, int, int] | None:
  """(coordinator, num_processes, process_id) from ORBAX_MTC_*, None if none is set."""
  present = [name for name in _LAUNCHER_VARS if os.environ.get(name, "").strip()]
  if not present:
    return None
  missing = [name for name in _LAUNCHER_VARS if name not in present]
  if missing:
    raise ValueError(
        f"{', '.join(present)} set but {', '.join(missing)} missing: set all of "
        f"{', '.join(_LAUNCHER_VARS)} (as `orbax-mtc launch` does) or none."
    )
  coordinator = os.environ[ORBAX_MTC_COORDINATOR].strip()
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f"{ORBAX_MTC_COORDINATOR}={coordinator!r} is not of the form HOST:PORT "
        "(e.g. 127.0.0.1:12345)."
    )
  num_processes = _env_int(ORBAX_MTC_NUM_PROCESSES, minimum=1)
  process_id = _env_int(ORBAX_MTC_PROCESS_ID, minimum=0)
  assert num_processes is not None and process_id is not None
  if process_id >= num_processes:
    raise ValueError(
        f"{ORBAX_MTC_PROCESS_ID}={process_id} is out of range for "
        f"{ORBAX_MTC_NUM_PROCESSES}={num_processes} (must be 0..{num_processes - 1})."
    )
  return coordinator, num_processes, process_id


def initialize(*, timeout_s: int = 120, heartbeat_timeout_s: int | None = None
               ) -> DistributedInfo:
  """Joins `jax.distributed` as the environment says, and returns who this process is.

  Order: already initialised -> no-op; `ORBAX_MTC_*` set -> join that coordinator; a cluster
  environment JAX can detect -> `jax.distributed.initialize()`; else single process, no
  `jax.distributed`. Also registers the exit hook described in the module docstring.

  Args:
    timeout_s: Longest wait in seconds for the other processes to join.
    heartbeat_timeout_s: Seconds without a heartbeat after which a process is declared dead
      and the others end with an error naming it (default: ORBAX_MTC_HEARTBEAT_TIMEOUT_S,
      else `HEARTBEAT_TIMEOUT_S`).

  Returns:
    The `DistributedInfo` of this process.

  Raises:
    ValueError: If the `ORBAX_MTC_*` variables (or the worker-index variables) are malformed
      or inconsistent, `ORBAX_MTC_LOCAL_DIR` is not an absolute path, or the heartbeat timeout
      is not a positive whole number of seconds.
    RuntimeError: If a JAX backend was started before this call, so it cannot join a job.
  """
  params = _launcher_params()  # validate even when already up: a bad env is a bug either way
  heartbeat = heartbeat_timeout(heartbeat_timeout_s)
  local_dir = local_directory()
  if local_dir is not None and not os.path.isabs(local_dir):
    raise ValueError(f"{ORBAX_MTC_LOCAL_DIR}={local_dir!r} must be an absolute path.")
  index = worker_index()

  if is_initialized():
    _register_exit_hook()
    info = _current_info()
    if params is not None:
      _, env_num_processes, env_process_id = params
      if (info.process_id, info.num_processes) != (env_process_id, env_num_processes):
        logging.warning(
            "jax.distributed already initialised as process %d of %d, but %s/%s say %d of %d;"
            " keeping the existing initialisation.",
            info.process_id, info.num_processes, ORBAX_MTC_PROCESS_ID,
            ORBAX_MTC_NUM_PROCESSES, env_process_id, env_num_processes,
        )
    return info

  if params is not None:
    coordinator, num_processes, process_id = params
    logging.info(
        "Joining jax.distributed at %s as process %d of %d.", coordinator, process_id,
        num_processes,
    )
    _jax_initialize(
        coordinator, num_processes=num_processes, process_id=process_id,
        initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=heartbeat,
    )
    return DistributedInfo(process_id, num_processes, coordinator, local_dir, index)

  cluster = detected_cluster()
  if cluster is not None:
    logging.info("Detected %s; initialising jax.distributed from it.", cluster)
    _jax_initialize(initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=heartbeat)
    return _current_info()

  logging.info("No launcher variables and no cluster environment: single process.")
  return DistributedInfo(0, 1, None, local_dir, index)


def join(coordinator: str, process_id: int, *, timeout_s: int = 120,
         shutdown_timeout_s: int = 300, heartbeat_timeout_s: int | None = None) -> None:
  """Joins `jax.distributed` at a coordinator named elsewhere (GKE's jax-init-info.txt).

  The process count comes from the launcher's variables when set, else JAX detects it. Also
  registers the exit hook described in the module docstring.

  Args:
    coordinator: Address of the coordinator, HOST:PORT.
    process_id: Rank of this process.
    timeout_s: Longest wait in seconds for the other processes to join.
    shutdown_timeout_s: Longest wait in seconds at JAX's shutdown barrier.
    heartbeat_timeout_s: As `initialize`.

  Raises:
    ValueError: If the `ORBAX_MTC_*` variables or the heartbeat timeout are malformed or
      inconsistent.
    RuntimeError: If a JAX backend was started before this call, so it cannot join a job.
  """
  params = _launcher_params()
  _jax_initialize(coordinator, num_processes=params[1] if params is not None else None,
                  process_id=process_id, initialization_timeout=int(timeout_s),
                  shutdown_timeout_seconds=int(shutdown_timeout_s),
                  heartbeat_timeout_seconds=heartbeat_timeout(heartbeat_timeout_s))


def heartbeat_timeout(seconds: int | None = None) -> int:
  """The heartbeat timeout to join with: `seconds`, else ORBAX_MTC_HEARTBEAT_TIMEOUT_S, else
  `HEARTBEAT_TIMEOUT_S`.

  Raises:
    ValueError: If it is not a positive whole number of seconds.
  """
  raw: object = seconds
  where = "heartbeat_timeout_s"
  if seconds is None:
    raw = os.environ.get(ORBAX_MTC_HEARTBEAT_TIMEOUT_S)
    where = ORBAX_MTC_HEARTBEAT_TIMEOUT_S
    if raw is None or raw == "":
      return HEARTBEAT_TIMEOUT_S
  try:
    value = int(str(raw))
  except ValueError:
    value = 0
  if isinstance(raw, bool) or value <= 0:
    raise ValueError(f"{where}={raw!r}: the heartbeat timeout must be a positive whole number "
                     f"of seconds (default {HEARTBEAT_TIMEOUT_S}).")
  return value


def _jax_initialize(*args, **kwargs) -> None:
  """`jax.distributed.initialize` with a clearer error when a backend is already up, and the
  exit hook that lets no collective outlive the job (see the module docstring)."""
  try:
    jax.distributed.initialize(*args, **kwargs)
  except RuntimeError as e:
    if "must be called before" in str(e):
      raise RuntimeError(
          "orbax_mtc.distributed.initialize() must run before any JAX computation or "
          "jax.devices() call in this process; move it to the top of the program."
      ) from e
    raise
  _register_exit_hook()


def _register_exit_hook() -> None:
  """Registers `_finish_collectives_at_exit` once. Registered after `import jax`, it runs before
  JAX's own exit hook (`jax._src.api.clean_up`, which shuts `jax.distributed` down)."""
  global _exit_hook_registered
  if not _exit_hook_registered:
    atexit.register(_finish_collectives_at_exit)
    _exit_hook_registered = True


def _exiting_on_error() -> bool:
  """Whether the interpreter is exiting on an uncaught exception (it sets these before atexit)."""
  return (getattr(sys, "last_exc", None) is not None
          or getattr(sys, "last_value", None) is not None)


def _finish_collectives_at_exit() -> None:
  """Exit hook: never raises; a failure only costs the protection it gives."""
  try:
    finish_collectives(
        EXIT_BARRIER_TIMEOUT_ON_ERROR_S if _exiting_on_error() else EXIT_BARRIER_TIMEOUT_S)
  except Exception as e:  # noqa: BLE001 - at exit, a warning is all that is left to give
    logging.warning("orbax-mtc: could not wait for in-flight collectives at exit: %s", e)


def finish_collectives(barrier_timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> bool:
  """Waits, with every process, until no collective of this job is still running anywhere.

  Runs at exit on its own (see the module docstring); call it before an explicit
  `jax.distributed.shutdown()`. Every process must call it, as many times as the others: they
  meet at a coordination-service barrier (at most `barrier_timeout_s`), then run one small
  collective on every device and wait for all of its shards. No-op without `jax.distributed`,
  with a single process, or when some process has never started a JAX backend (nothing was
  computed, so nothing can be in flight, and a collective would start a backend just to leave).

  Args:
    barrier_timeout_s: Longest wait in seconds at the barrier.

  Returns:
    True when the collectives were waited for; False when there was nothing to do, or some
    process did not reach the barrier in time (it is still running or failed: then nothing is
    waited for, as before).

  Raises:
    RuntimeError: If the final collective returns a wrong sum.
  """
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge

  state = jax_distributed.global_state
  client = state.client
  if client is None or state.num_processes <= 1:
    return False
  has_backend = xla_bridge.backends_are_initialized()
  name = f"{_EXIT_KEY}_{next(_finish_calls)}"
  try:
    client.key_value_set(f"{name}/{state.process_id}", "1" if has_backend else "0")
    client.wait_at_barrier(name, int(barrier_timeout_s * 1000))
    # Every process set its flag before the barrier, so every process reads the same ones.
    flags = dict(client.key_value_dir_get(f"{name}/"))
  except Exception as e:  # noqa: BLE001 - the service's errors have no public type
    logging.warning(
        "orbax-mtc: not every process reached the exit barrier (waited at most %.0f s; %s: "
        "%s); leaving without waiting for collectives still in flight.",
        barrier_timeout_s, type(e).__name__, e)
    return False
  if len(flags) != state.num_processes or set(flags.values()) != {"1"}:
    return False
  _run_final_collective()
  return True


def _run_final_collective() -> None:
  """One reduction over every device of the job, waited for on every local device."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("devices",))
  ones = jax.make_array_from_callback(
      (len(devices),), NamedSharding(mesh, PartitionSpec("devices")),
      lambda index: np.ones(1, np.int32))
  with jax.set_mesh(None):  # a mesh the user set need not be this one
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones)
  total.block_until_ready()  # every local shard, not only the first
  if int(np.asarray(total.addressable_data(0))) != len(devices):
    raise RuntimeError(f"final collective summed to {total.addressable_data(0)}, "
                       f"not {len(devices)}")
