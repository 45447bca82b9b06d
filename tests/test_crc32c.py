"""The local tier's CRC32C (google-crc32c) gives the values the `crc32c` package gave: manifests
and checksums written before the switch stay valid. Chunked and pipelined checksums equal
one-shot ones, at sizes that are not multiples of 8 and across chunk boundaries."""

from __future__ import annotations

import hashlib
import os

import google_crc32c
import numpy as np
import pytest

from orbax_mtc.local import checksum
from orbax_mtc.local import read as local_read
from orbax_mtc.local.format import manifest_checksum
from orbax_mtc.local.read import aligned_empty

pytestmark = pytest.mark.timeout(120)

# CRC32C of _pattern(n), computed with crc32c 2.9 (the package this project used before).
KNOWN = [
    (0, 0x00000000),
    (1, 0xd08b6829),
    (3, 0x2dff6341),
    (7, 0x4637eb4d),
    (8, 0xf21c5c96),
    (9, 0xb2c9687e),
    (15, 0xc1a9325c),
    (16, 0x0c5dec56),
    (17, 0x5ec1c0db),
    (255, 0x5ac8abb9),
    (4097, 0xa0416cf2),
    (65537, 0x56ae0410),
    ((1 << 20) + 5, 0x788b5170),
]
SIZES = [n for n, _ in KNOWN]


@pytest.fixture(params=["nogil", "extension"])
def crc_path(request, monkeypatch):
  """Every call through ctypes (GIL released), or every call through google_crc32c.extend."""
  if request.param == "nogil":
    assert checksum._CRC32C_EXTEND_NOGIL is not None  # resolved on Linux wheels
    monkeypatch.setattr(checksum, "_CRC_NOGIL_MIN", 0)
  else:
    monkeypatch.setattr(checksum, "_CRC32C_EXTEND_NOGIL", None)
  return request.param


def _pattern(n: int) -> bytes:
  """`n` pseudo-random bytes that no library version can change (unlike numpy's generators)."""
  return hashlib.shake_256(b"orbax-mtc crc32c %d" % n).digest(n)


def _reference(data: bytes) -> int:
  """CRC32C bit by bit (reflected Castagnoli polynomial), independent of any library."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
  return crc ^ 0xFFFFFFFF


def test_c_extension_in_use():
  assert google_crc32c.implementation == "c"


def test_pure_python_fallback_refused():
  with pytest.raises(ImportError, match="pure-Python"):
    checksum._require_crc32c_extension("python")
  checksum._require_crc32c_extension("c")


def test_check_value(crc_path):
  assert checksum.crc(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283


@pytest.mark.parametrize("nbytes,expected", KNOWN)
def test_known_values(crc_path, nbytes, expected):
  data = _pattern(nbytes)
  if nbytes <= 4097:
    assert _reference(data) == expected
  assert checksum.crc(np.frombuffer(data, np.uint8)) == expected
  assert google_crc32c.value(data) == expected


def test_manifest_checksum_unchanged():
  # crc32c 2.9 signed {"format":"orbax-mtc/local/2","items":{},"step":7} with 0x4f919d9d.
  fields = {"step": 7, "format": "orbax-mtc/local/2", "items": {}}
  assert manifest_checksum(fields) == 0x4f919d9d == _reference(
      b'{"format":"orbax-mtc/local/2","items":{},"step":7}')


@pytest.mark.parametrize("chunk", [1, 5, 8, 4099, 1 << 16])
def test_chunked_equals_one_shot(crc_path, monkeypatch, chunk):
  monkeypatch.setattr(checksum, "CRC_CHUNK", chunk)
  for nbytes in SIZES:
    data = np.frombuffer(_pattern(nbytes), np.uint8)
    if chunk == 1 and nbytes > 65537:
      continue  # a million one-byte calls prove nothing more
    assert checksum.crc(data) == google_crc32c.value(data.tobytes())
  # Slices at odd offsets (views into one buffer, as shards are).
  data = np.frombuffer(_pattern((1 << 20) + 5), np.uint8)
  ranges = [(0, 0), (3, 17), (20, 4099), (4119, 65537), (69656, (1 << 20) + 5 - 69656)]
  assert checksum.crc_ranges(data, ranges) == [google_crc32c.value(data[o:o + n].tobytes())
                                               for o, n in ranges]


def test_read_checksumming_equals_one_shot(crc_path, monkeypatch, shm_dir):
  monkeypatch.setattr(local_read, "_PIPELINE_PIECE", 4099)  # pieces that split every range
  raw = _pattern((1 << 20) + 5)
  path = shm_dir / "data.bin"
  path.write_bytes(raw)
  ranges = [(0, 1), (1, 7), (8, 65537), (65545, 9), (65554, len(raw) - 65554), (3, 17)]
  buffer = aligned_empty(len(raw))
  fd = os.open(path, os.O_RDONLY)
  try:
    got = local_read._read_checksumming(fd, path, buffer, ranges)
  finally:
    os.close(fd)
  assert buffer.tobytes() == raw
  assert got == {(o, n): google_crc32c.value(raw[o:o + n]) for o, n in ranges}


def test_buffers_without_copy(crc_path):
  # google-crc32c reads numpy arrays, read-only ones too, in place; not memoryviews.
  data = np.frombuffer(_pattern(4097), np.uint8)
  assert not data.flags.writeable
  assert google_crc32c.extend(0, data[1:]) == google_crc32c.value(_pattern(4097)[1:])
  with pytest.raises(TypeError):
    google_crc32c.value(memoryview(data))
  with pytest.raises((TypeError, ValueError)):
    checksum.crc(data[::2])  # never the checksum of other bytes


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4097, (1 << 20) + 5, 2 * (16 << 20) + 3])
def test_same_as_crc32c_package(crc_path, nbytes):
  crc32c = pytest.importorskip("crc32c", reason="dev-only comparison with the old dependency")
  data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
  assert checksum.crc(data) == crc32c.crc32c(data)
  half = nbytes // 2 + 1
  assert google_crc32c.extend(google_crc32c.value(data[:half]), data[half:]) == crc32c.crc32c(data)
