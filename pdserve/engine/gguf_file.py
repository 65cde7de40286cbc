"""A small, fast GGUF (v2/v3) reader: metadata as Python values, tensors as memory maps.

`gguf.GGUFReader` builds numpy views for every metadata item, which costs
~7 s on a 49K-token vocabulary here; start-up time matters (a worker that
restarts is a worker that is not serving), so we parse the header with
`struct` and only use the `gguf` package for block sizes and exotic
dequantization.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (PyTorch) order: ggml's dims reversed
    type_id: int
    type_name: str
    data: np.ndarray  # raw bytes (uint8), a view of the memory map


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"header is truncated or corrupt ({e})") from e

    # ---- primitive readers
    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._mv, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise GGUFFormatError("string runs past the end of the file")
        s = bytes(self._mv[self._pos : self._pos + n]).decode("utf-8", "replace")
        self._pos += n
        return s

    def _value(self, type_id: int):
        if type_id == _STRING:
            return self._string()
        if type_id == _ARRAY:
            item_type, n = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(n)]
            if item_type not in _SCALARS:
                raise GGUFFormatError(f"array of unsupported type {item_type}")
            dtype = np.dtype(_SCALARS[item_type][1:] if item_type != 7 else "?").newbyteorder("<")
            arr = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos)
            self._pos += n * dtype.itemsize
            return arr.tolist()
        if type_id not in _SCALARS:
            raise GGUFFormatError(f"metadata value of unknown type {type_id}")
        return self._unpack(_SCALARS[type_id])

    # ---- layout
    def _parse(self) -> None:
        import gguf

        if bytes(self._mv[:4]) != b"GGUF":
            raise GGUFFormatError("not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, offset in infos:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if dims else 1
            nbytes = n // block * type_size
            begin = start + offset
            if begin + nbytes > len(self._buf):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(
                GGUFTensor(name, tuple(reversed(dims)), type_id, qtype.name, self._buf[begin : begin + nbytes])
            )

    def get(self, key: str, default=None):
        return self.fields.get(key, default)
