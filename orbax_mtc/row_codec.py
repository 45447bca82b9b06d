"""One int64 row per agreement record: field codecs, `encode` and `decode`.

A record (agreement.py) is a frozen dataclass whose fields carry their codec
(`field(Int())`, `field(Steps(32))`, ...). `encode` lays the fields out in order, each in a
fixed number of int64 slots, so every process's row has the same width; `decode` reads them
back. These two are the only readers and writers of the layout.

Pure: numpy only, no I/O and no JAX.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection
from typing import Any, TypeVar

import numpy as np


class Codec:
  size: int

  def encode(self, value: Any) -> list[int]:
    raise NotImplementedError

  def decode(self, slots: np.ndarray) -> Any:
    raise NotImplementedError


class Int(Codec):
  size = 1

  def encode(self, value: Any) -> list[int]:
    return [int(value)]

  def decode(self, slots: np.ndarray) -> int:
    return int(slots[0])


class Bool(Int):
  def decode(self, slots: np.ndarray) -> bool:  # type: ignore[override]
    return bool(slots[0])


class EnumCodec(Int):
  def __init__(self, enum_type: type[enum.IntEnum]):
    self.enum_type = enum_type

  def decode(self, slots: np.ndarray) -> enum.IntEnum:  # type: ignore[override]
    return self.enum_type(int(slots[0]))


class Steps(Codec):
  """Up to `width` non-negative ints, newest first; a count says how many were sent and
  whether the list was cut."""

  def __init__(self, width: int):
    self.width = width
    self.size = 2 + width

  def encode(self, value: Collection[int]) -> list[int]:
    values = sorted({int(v) for v in value}, reverse=True)
    kept = values[:self.width]
    return [len(kept), int(len(values) > self.width)] + kept + [-1] * (self.width - len(kept))

  def decode(self, slots: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in slots[2:2 + int(slots[0])])

  @staticmethod
  def truncated(slots: np.ndarray) -> bool:
    return bool(slots[1])


class Pairs(Codec):
  """Up to `width` (a, b) pairs of non-negative ints, newest b first."""

  def __init__(self, width: int):
    self.width = width
    self.size = 1 + 2 * width

  def encode(self, value: Collection[tuple[int, int]]) -> list[int]:
    pairs = sorted({(int(a), int(b)) for a, b in value}, key=lambda p: (-p[1], p[0]))
    kept = pairs[:self.width]
    flat = [x for pair in kept for x in pair]
    return [len(kept)] + flat + [-1] * (2 * (self.width - len(kept)))

  def decode(self, slots: np.ndarray) -> tuple[tuple[int, int], ...]:
    n = int(slots[0])
    flat = slots[1:1 + 2 * n]
    return tuple((int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(n))


class Text(Codec):
  """UTF-8 text cut to `nbytes` (on a character boundary), packed eight bytes a slot."""

  def __init__(self, nbytes: int):
    self.nbytes = -(-nbytes // 8) * 8
    self.size = 1 + self.nbytes // 8

  def encode(self, value: str) -> list[int]:
    raw = value.encode("utf-8")[:self.nbytes].decode("utf-8", "ignore").encode("utf-8")
    padded = raw + b"\0" * (self.nbytes - len(raw))
    return [len(raw)] + np.frombuffer(padded, dtype=np.int64).tolist()

  def decode(self, slots: np.ndarray) -> str:
    raw = np.asarray(slots[1:], dtype=np.int64).tobytes()[:int(slots[0])]
    return raw.decode("utf-8", "replace")


class Blob(Codec):
  """Up to `nbytes` raw bytes, packed eight bytes a slot; longer values are refused."""

  def __init__(self, nbytes: int):
    self.nbytes = -(-nbytes // 8) * 8
    self.size = 1 + self.nbytes // 8

  def encode(self, value: bytes) -> list[int]:
    if len(value) > self.nbytes:
      raise ValueError(f"{len(value)} bytes do not fit a {self.nbytes}-byte field")
    padded = bytes(value) + b"\0" * (self.nbytes - len(value))
    return [len(value)] + np.frombuffer(padded, dtype=np.int64).tolist()

  def decode(self, slots: np.ndarray) -> bytes:
    return np.asarray(slots[1:], dtype=np.int64).tobytes()[:int(slots[0])]


class Record(Codec):
  def __init__(self, record_type: type):
    self.record_type = record_type
    self.size = row_size(record_type)

  def encode(self, value: Any) -> list[int]:
    return encode(value).tolist()

  def decode(self, slots: np.ndarray) -> Any:
    return decode(self.record_type, slots)


def field(codec: Codec, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
  if factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=factory, metadata={"codec": codec})
  return dataclasses.field(default=default, metadata={"codec": codec})


def codecs(record_type: type) -> list[tuple[str, Codec]]:
  return [(f.name, f.metadata["codec"]) for f in dataclasses.fields(record_type)]


def row_size(record_type: type) -> int:
  """Number of int64 values in the row of a record type.

  Args:
    record_type: A record dataclass of this module.

  Returns:
    The sum of the sizes of its fields' codecs.
  """
  return sum(codec.size for _, codec in codecs(record_type))


def encode(record: Any) -> np.ndarray:
  """Encodes a record as one int64 row (the only writer of the layout).

  Args:
    record: An instance of a record dataclass of this module.

  Returns:
    A 1-D int64 array of `row_size(type(record))` values.
  """
  row: list[int] = []
  for name, codec in codecs(type(record)):
    slots = codec.encode(getattr(record, name))
    assert len(slots) == codec.size, (name, len(slots), codec.size)
    row += slots
  return np.asarray(row, dtype=np.int64)


R = TypeVar("R")


def decode(record_type: type[R], row: np.ndarray) -> R:
  """Decodes the record `encode` wrote into `row` (the only reader of the layout).

  Args:
    record_type: The record dataclass that was encoded.
    row: The int64 values (any shape; flattened).

  Returns:
    The decoded record.

  Raises:
    ValueError: If `row` does not have `row_size(record_type)` values (e.g. processes run
      different orbax-mtc versions).
  """
  row = np.asarray(row, dtype=np.int64).reshape(-1)
  if row.size != row_size(record_type):
    raise ValueError(f"{record_type.__name__}: a row of {row.size} values, expected "
                     f"{row_size(record_type)} (processes run different orbax-mtc versions?)")
  values, at = {}, 0
  for name, codec in codecs(record_type):
    values[name] = codec.decode(row[at:at + codec.size])
    at += codec.size
  return record_type(**values)
