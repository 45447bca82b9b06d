"""Joining `jax.distributed`, from our launcher's environment or a real cluster's.

`orbax-mtc launch` (see `orbax_mtc.launch`) starts N local processes, each playing one host, and
tells each who it is through the `ORBAX_MTC_*` variables below. On a real cluster (Cloud TPU pod,
SLURM, Open MPI, Kubernetes) those are absent and JAX's own cluster detection finds the
coordinator. With neither, the job runs as a single process without `jax.distributed`, which the
checkpoint manager supports (RAM tier + persistent tier, SIGTERM through our own handler).

`initialize()` must run before anything that starts a JAX backend (`jax.devices()`, any
computation), as `jax.distributed.initialize` requires.
"""

from __future__ import annotations

import dataclasses
import os

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
    "initialize",
    "is_initialized",
    "local_directory",
    "worker_index",
]

# Environment contract between `orbax_mtc.launch` and its children.
ORBAX_MTC_COORDINATOR = "ORBAX_MTC_COORDINATOR"  # "127.0.0.1:PORT"
ORBAX_MTC_NUM_PROCESSES = "ORBAX_MTC_NUM_PROCESSES"
ORBAX_MTC_PROCESS_ID = "ORBAX_MTC_PROCESS_ID"
ORBAX_MTC_LOCAL_DIR = "ORBAX_MTC_LOCAL_DIR"  # this process's own RAM-disk folder
ORBAX_MTC_WORKER_INDEX = "ORBAX_MTC_WORKER_INDEX"  # index of the process inside its host

_LAUNCHER_VARS = (ORBAX_MTC_COORDINATOR, ORBAX_MTC_NUM_PROCESSES, ORBAX_MTC_PROCESS_ID)


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """Who this process is in the job.

  `coordinator` is None when running single-process (no `jax.distributed`).
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
  """Whether `jax.distributed` has been initialised in this process."""
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
  """
  for name in (ORBAX_MTC_WORKER_INDEX, "TPU_WORKER_ID", "LOCAL_RANK"):
    value = _env_int(name, minimum=0)
    if value is not None:
      return value
  return 0


def local_directory(default: str | None = None) -> str | None:
  """This process's RAM-disk folder as set by the launcher (ORBAX_MTC_LOCAL_DIR), else `default`."""
  return os.environ.get(ORBAX_MTC_LOCAL_DIR) or default


def detected_cluster() -> str | None:
  """Name of the cluster environment JAX's auto-detection would use, or None.

  Asks every registered `jax._src.clusters.ClusterEnv` (Cloud TPU on GCE/GKE, SLURM, Open MPI,
  Kubernetes) whether it is present, skipping opt-in-only ones (mpi4py), which is the same
  selection `jax.distributed.initialize()` makes with no arguments. JAX has no public API for
  this question; the `ClusterEnv` registry has been stable since JAX 0.4.
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


def initialize(*, timeout_s: int = 120) -> DistributedInfo:
  """Joins `jax.distributed` as the environment says, and returns who this process is.

  Order: already initialised -> no-op; `ORBAX_MTC_*` set -> join that coordinator; a cluster
  environment JAX can detect -> `jax.distributed.initialize()`; else single process, no
  `jax.distributed`. `timeout_s` bounds the wait for the other processes to join.

  Raises:
    ValueError: malformed or inconsistent `ORBAX_MTC_*` variables.
    RuntimeError: a JAX backend was started before this call, so it cannot join a job.
  """
  params = _launcher_params()  # validate even when already up: a bad env is a bug either way
  local_dir = local_directory()
  if local_dir is not None and not os.path.isabs(local_dir):
    raise ValueError(f"{ORBAX_MTC_LOCAL_DIR}={local_dir!r} must be an absolute path.")
  index = worker_index()

  if is_initialized():
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
        initialization_timeout=int(timeout_s),
    )
    return DistributedInfo(process_id, num_processes, coordinator, local_dir, index)

  cluster = detected_cluster()
  if cluster is not None:
    logging.info("Detected %s; initialising jax.distributed from it.", cluster)
    _jax_initialize(initialization_timeout=int(timeout_s))
    return _current_info()

  logging.info("No launcher variables and no cluster environment: single process.")
  return DistributedInfo(0, 1, None, local_dir, index)


def join(coordinator: str, process_id: int, *, timeout_s: int = 120,
         shutdown_timeout_s: int = 300) -> None:
  """Joins `jax.distributed` at a coordinator named elsewhere (GKE's jax-init-info.txt). The
  process count comes from the launcher's variables when set, else JAX detects it."""
  params = _launcher_params()
  _jax_initialize(coordinator, num_processes=params[1] if params is not None else None,
                  process_id=process_id, initialization_timeout=int(timeout_s),
                  shutdown_timeout_seconds=int(shutdown_timeout_s))


def _jax_initialize(*args, **kwargs) -> None:
  """`jax.distributed.initialize` with a clearer error when a backend is already up."""
  try:
    jax.distributed.initialize(*args, **kwargs)
  except RuntimeError as e:
    if "must be called before" in str(e):
      raise RuntimeError(
          "orbax_mtc.distributed.initialize() must run before any JAX computation or "
          "jax.devices() call in this process; move it to the top of the program."
      ) from e
    raise
