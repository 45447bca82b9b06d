"""The restore exchange's streams carry their own length (peers/exchange.py): a receiver
keeps exactly the payload, whatever the round's padding and the chunking."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_mtc import transport
from orbax_mtc.local import format as local_format
from orbax_mtc.peers import exchange


class _Payload:
  """An outgoing stream over bytes in memory (OutgoingStream's read/nbytes)."""

  def __init__(self, data: np.ndarray):
    self.data, self.nbytes = data, data.nbytes

  def read(self, offset: int, out: np.ndarray) -> None:
    out[:] = self.data[offset:offset + out.nbytes]


def _move(payload: np.ndarray, bound: int, chunk: int) -> dict[int, np.ndarray]:
  """Sends `payload` framed through chunks of `chunk` bytes, zeros past its end up to the
  round's `bound`, as the transfer does; returns what the receiver's sink kept."""
  framed = payload.nbytes + exchange.FRAME
  read = exchange._framed_reader(_Payload(payload))
  kept: dict[int, np.ndarray] = {}

  def sink_for(stream: transport.Stream) -> transport.Sink:
    kept[stream.source] = local_format.aligned_empty(stream.nbytes)
    return lambda offset, data: kept[stream.source].__setitem__(
        slice(offset, offset + data.nbytes), data)

  sink = exchange._unframing_sink(transport.Stream(3, 0, bound), sink_for)
  for offset in range(0, bound, chunk):
    out = np.zeros(min(chunk, bound - offset), np.uint8)
    n = max(0, min(out.nbytes, framed - offset))
    read(offset, out[:n])
    sink(offset, out)
  return kept


@pytest.mark.parametrize("size, bound, chunk", [
    (1, 4096, 4096), (4096, 8192, 4096), (5000, 16384, 4096), (70000, 131072, 8192),
    (4096 - exchange.FRAME, 4096, 4096)])
def test_the_receiver_keeps_exactly_the_payload(size, bound, chunk):
  payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
  kept = _move(payload, bound, chunk)
  assert kept[3].nbytes == size
  np.testing.assert_array_equal(kept[3], payload)
  assert kept[3].ctypes.data % local_format.ALIGN == 0  # aligned: JAX adopts it in place


def test_a_length_beyond_the_round_is_refused():
  sink = exchange._unframing_sink(transport.Stream(1, 0, 4096), lambda s: None)
  first = np.zeros(4096, np.uint8)
  first[:8] = np.frombuffer((10**6).to_bytes(8, "little"), np.uint8)
  with pytest.raises(local_format.CorruptStepError, match="a stream of 1000000 bytes"):
    sink(0, first)
