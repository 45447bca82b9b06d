"""Sending a restore's tiles straight from their files: a tile that cannot be read never
raises between two chunks of a transfer (the receiving process would be left inside the
collective); it goes as zeros, the receiver's checksum rejects it, and the sender's report
says whether the folder is damaged (excluded) or the error proves nothing (raised
everywhere, nothing excluded)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from orbax_mtc.agreement import Status
from orbax_mtc.local.format import CorruptStepError
from orbax_mtc.local.read import aligned_empty
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.restore import attempt


def _stream(path, nbytes: int, *, failures) -> peer_stream.OutgoingStream:
  head = np.arange(64, dtype=np.uint8)
  return peer_stream.OutgoingStream(nbytes=64 + nbytes, segments=[
      peer_stream.Segment(0, 64, buffer=head),
      peer_stream.Segment(64, nbytes, path=path, file_offset=0, tag=3)], failures=failures)


def _read_all(stream: peer_stream.OutgoingStream) -> np.ndarray:
  out = aligned_empty(stream.nbytes)
  out[:] = 0xAA
  for offset in range(0, stream.nbytes, 100):  # in chunks, as a transfer reads
    stream.read(offset, out[offset:min(stream.nbytes, offset + 100)])
  return out


def test_a_readable_file_segment_is_sent_as_it_is(tmp_path):
  data = np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)
  (tmp_path / "data.bin").write_bytes(data.tobytes())
  stream = _stream(tmp_path / "data.bin", 300, failures=[])
  out = _read_all(stream)
  assert np.array_equal(out[:64], np.arange(64, dtype=np.uint8))
  assert np.array_equal(out[64:], data)
  assert stream.failures == []


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_an_unreadable_file_segment_goes_as_zeros_and_is_named_once(tmp_path, damage):
  path = tmp_path / "data.bin"
  if damage == "short":
    path.write_bytes(b"\x07" * 120)
  stream = _stream(path, 300, failures=[])
  out = _read_all(stream)
  assert np.array_equal(out[:64], np.arange(64, dtype=np.uint8))  # the header still goes
  assert not out[64 + 120:].any()  # what the file lacks (and the rest of its chunk) is zeros
  assert len(stream.failures) == 1
  tag, error = stream.failures[0]
  assert tag == 3
  assert isinstance(error, FileNotFoundError if damage == "missing" else CorruptStepError)


def test_without_a_failure_list_an_unreadable_segment_raises(tmp_path):
  stream = _stream(tmp_path / "gone.bin", 300, failures=None)
  with pytest.raises(FileNotFoundError):
    _read_all(stream)


def _sent(failures):
  stream = peer_stream.OutgoingStream(nbytes=0, segments=[], failures=failures)
  return {1: stream}


def test_a_sender_whose_tiles_all_went_out_reports_nothing():
  assert attempt._moving_outcome(0, 9, _sent([]), []) is None


@pytest.mark.parametrize("error", [
    FileNotFoundError(errno.ENOENT, "gone"),
    CorruptStepError("short read while sending a copy"),
])
def test_a_damaged_sent_folder_is_named_for_exclusion(error):
  record = attempt._moving_outcome(2, 9, _sent([(5, error)]), [])
  assert (record.status, record.bad_process, record.bad_rank) == (Status.UNUSABLE, 2, 5)
  assert "saved rank 5" in record.message


def test_an_error_that_proves_no_damage_is_raised_everywhere_not_excluded():
  record = attempt._moving_outcome(
      2, 9, _sent([(5, OSError(errno.EIO, os.strerror(errno.EIO)))]), [])
  assert record.status == Status.FAILED and record.bad_process == -1
  assert "Input/output error" in record.message


def test_a_chunk_that_could_not_be_placed_or_received_is_raised_everywhere():
  record = attempt._moving_outcome(1, 9, _sent([]), ["placing a chunk of 4096 bytes: "
                                                     "XlaRuntimeError: RESOURCE_EXHAUSTED"])
  assert record.status == Status.FAILED and "RESOURCE_EXHAUSTED" in record.message
