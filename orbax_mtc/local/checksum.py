"""CRC32C of shard bytes, computed without holding the GIL.

Every shard's checksum is computed while a save writes it and again while a restore reads it,
in threads beside the training loop. google-crc32c's C extension is required: without it the
package falls back to pure Python at about 3 MiB/s, and importing this module fails instead.
`google_crc32c.extend` holds the GIL for anything but `bytes`, so large buffers go to the same
C library's `crc32c_extend` through ctypes, which releases it; where that symbol cannot be
resolved (or gives another value on a probe) checksums hold the GIL, with a warning.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections.abc import Callable, Sequence

import google_crc32c
import numpy as np

CRC_CHUNK = 16 << 20  # bytes per call: a large buffer's checksum is computed this much at a time
_CRC_NOGIL_MIN = 64 << 10  # below this a call is shorter than handing the GIL over


def _require_crc32c_extension(implementation: str) -> None:
  """ImportError unless google-crc32c runs its C extension. Where it cannot import it, it falls
  back to pure Python with only a warning: about 3 MiB/s, so a save would seem to hang."""
  if implementation != "c":
    raise ImportError(
        "google-crc32c is using its pure-Python implementation (about 3 MiB/s: minutes per GiB "
        "of checkpoint) because its C extension could not be imported. Install a "
        "google-crc32c wheel for this platform, or build it where a C compiler is available.")


def _crc32c_extend_nogil() -> Callable[[int, int, int], int] | None:
  """`crc32c_extend(crc, address, length)` of the C library inside google-crc32c, called through
  ctypes, which releases the GIL for the call. google_crc32c.extend keeps the GIL for anything
  but `bytes`, so checksum threads would stall the writer, the reader and the training loop.
  None where the extension's handle does not resolve the symbol (Windows, other builds)."""
  try:
    function = ctypes.CDLL(sys.modules[google_crc32c.extend.__module__].__file__).crc32c_extend
  except (AttributeError, KeyError, OSError, TypeError):
    return None
  function.restype = ctypes.c_uint32
  function.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
  probe = bytes(range(256)) * 3
  if function(0x1234, probe, len(probe)) != google_crc32c.extend(0x1234, probe):
    return None
  return function


_require_crc32c_extension(google_crc32c.implementation)
_CRC32C_EXTEND_NOGIL = _crc32c_extend_nogil()
if _CRC32C_EXTEND_NOGIL is None:
  warnings.warn("orbax-mtc: google-crc32c's crc32c_extend is not reachable through ctypes; "
                "checksums hold the GIL (correct, but they stall other Python threads)",
                RuntimeWarning, stacklevel=1)


def crc_extend(value: int, data: np.ndarray) -> int:
  """The CRC32C of `data` continuing `value`; large data without holding the GIL.

  Args:
    value: the CRC32C of the bytes before `data` (0 to start).
    data: C-contiguous bytes, of any dtype.

  Returns:
    The CRC32C of the bytes before and `data`.

  Raises:
    ValueError: `data` is not C-contiguous.
  """
  if data.nbytes < _CRC_NOGIL_MIN or _CRC32C_EXTEND_NOGIL is None:
    return google_crc32c.extend(value, data)
  if not data.flags.c_contiguous:  # the address alone would checksum other bytes
    raise ValueError("CRC32C of an array that is not C-contiguous")
  return _CRC32C_EXTEND_NOGIL(value, data.ctypes.data, data.nbytes)


def crc(data: np.ndarray) -> int:
  """The CRC32C of `data` (uint8, C-contiguous), computed `CRC_CHUNK` bytes at a time."""
  value = 0
  for start in range(0, data.nbytes, CRC_CHUNK):
    value = crc_extend(value, data[start:start + CRC_CHUNK])
  return value


def crc_ranges(buffer: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[int]:
  """The CRC32C of each (offset, nbytes) range of `buffer` (uint8), in order."""
  return [crc(buffer[offset:offset + nbytes]) for offset, nbytes in ranges]
