"""The all-reduce the agreements use, behind a barrier that cannot wait forever.

A process that raised, or was killed, before an agreement would leave the others blocked in the
collective for good (gloo and NCCL collectives have no timeout of their own). So each agreement
first meets at a coordination-service barrier with a timeout; when it expires, every process
that did arrive raises an error naming the processes that did not. Main thread only (rule 2).
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import numpy as np
from jax.sharding import PartitionSpec

from orbax_mtc import node_mesh, reduction

# Re-exported: this error lived here before errors.py; other modules name it through this one.
from orbax_mtc.errors import AgreementTimeoutError as AgreementTimeoutError
from orbax_mtc.reduction import LOW, Parts

# Barrier ids must be the same on every process and never reused in one job: every process
# makes the same agreements in the same order, so one counter per process numbers them alike.
_sequence = itertools.count()
# How the coordination service names the tasks that never reached a barrier.
_MISSING = re.compile(r"timed out task names:\s*([\d,\s]+)")


def _client():
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state.client


def _missing_processes(error: Exception) -> list[int] | None:
  """The processes a timed-out barrier names as missing (None when it names none). Asked of
  the error, not of the service's liveness call, which blocks until its heartbeat timeout."""
  found = _MISSING.search(str(error))
  if found is None:
    return None
  return sorted(int(p) for p in re.findall(r"\d+", found.group(1)))


def barrier(what: str, process_count: int, timeout_s: float, *, kind: str = "") -> None:
  """Waits until every process reaches the same agreement, at most `timeout_s`.

  Returns at once for a single process or when there is no coordination service.

  Args:
    what: What the agreement is for, named in the error.
    process_count: Number of processes in the job.
    timeout_s: Longest wait in seconds.
    kind: Names the agreement's kind in the barrier's id, so that processes at different
      agreements (one left a call with an error and entered another) never meet: they time
      out with this error instead of entering one collective with rows of different sizes,
      which aborts every process.

  Raises:
    AgreementTimeoutError: If not every process reached the barrier within `timeout_s`.
  """
  if process_count == 1:
    return
  client = _client()
  if client is None:  # no coordination service: nothing to wait on but the collective
    return
  name = f"orbax_mtc_agreement_{next(_sequence)}{'_' + kind if kind else ''}"
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - the service's errors have no public type
    gone = _missing_processes(e)
    who = f"process(es) {gone} did not arrive" if gone else (
        "some processes did not arrive (the coordination service's words are below)")
    raise AgreementTimeoutError(
        f"orbax-mtc: {what}: not every process arrived within {timeout_s:.0f} s: {who}. "
        "A process failed, hangs or was killed before this point, or left an earlier call "
        "with an error and is at another agreement; see its log. Committed steps are "
        f"untouched. ({type(e).__name__}: {e})") from e


# Each process's vectors go in once, the same on each of its devices in the mesh (node_mesh.py
# says why there may be two): reduced over the processes only.
_AXIS = node_mesh.AXIS


@functools.lru_cache(maxsize=64)
def _reduce_fn(shape: tuple[int, int, int]):
  del shape  # one compiled function per vector sizes
  mesh = node_mesh.node_mesh()
  spec = PartitionSpec(_AXIS)

  def body(add, top, flags):
    return (jax.lax.psum(add, _AXIS), jax.lax.pmax(top, _AXIS), jax.lax.pmax(flags, _AXIS))

  return node_mesh.outside_user_mesh(
      jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3)))


@functools.lru_cache(maxsize=64)
def _gather_fn(size: int):
  """One all-gather of every process's `size`-byte row (a gathered round)."""
  del size  # one compiled function per row size
  mesh = node_mesh.node_mesh()
  return node_mesh.outside_user_mesh(jax.jit(jax.shard_map(
      lambda row: jax.lax.all_gather(row, _AXIS, tiled=True), mesh=mesh,
      in_specs=PartitionSpec(_AXIS), out_specs=PartitionSpec(), check_vma=False)))


def _padded(size: int) -> int:
  return max(8, 1 << (size - 1).bit_length())


def allreduce(parts: Parts, what: str, process_count: int, timeout_s: float) -> Parts:
  """Sums `parts.add` and maxes `parts.top` and `parts.flags` over every process, after a
  bounded barrier: each process receives vectors of the size it sent, whatever the count (a
  small round is one all-gather reduced here, a larger one all-reduces: reduction.gathers).

  Args:
    parts: This process's contribution; the same shape on every process.
    what: What the agreement is for, named in a timeout error.
    process_count: Number of processes in the job.
    timeout_s: Longest wait at the barrier in seconds.

  Returns:
    The reduced vectors (the same on every process).

  Raises:
    AgreementTimeoutError: If not every process reached the barrier within `timeout_s`.
  """
  if process_count == 1:
    return parts
  add, top, flags = parts.shape
  # The sizes tell the agreements' rounds apart.
  barrier(what, process_count, timeout_s, kind=f"r{add}-{top}-{flags}")
  me = jax.process_index()
  if reduction.gathers(parts.nbytes, process_count):
    row = reduction.row_bytes(parts)
    row = np.concatenate([row, np.zeros(_padded(row.size) - row.size, np.uint8)])
    gathered = _gather_fn(row.size)(node_mesh.replicated_input(row, me))
    rows = np.asarray(gathered.addressable_shards[0].data).reshape(-1, row.size)
    return reduction.combine_rows(rows, parts.shape)
  # Each vector is padded with the reduction's identity to a power of two (at least 8), so
  # that the few shapes the rounds take share their compiled functions.
  vectors = [np.concatenate([v, np.full(_padded(v.size) - v.size, fill, v.dtype)])
             for v, fill in ((parts.add, 0), (parts.top, LOW), (parts.flags, 0))]
  inputs = [node_mesh.replicated_input(v, me) for v in vectors]
  outputs = _reduce_fn(tuple(v.size for v in vectors))(*inputs)
  add_r, top_r, flags_r = (np.asarray(o.addressable_shards[0].data) for o in outputs)
  return Parts(add_r[:add].copy(), top_r[:top].copy(), flags_r[:flags].copy())
