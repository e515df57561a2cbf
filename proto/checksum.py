"""CRC32C (Castagnoli) over payload bytes, with google_crc32c's native code.

``crc32c(buf)`` takes bytes, a memoryview or a numpy array, so the sender can
checksum an activation in place (no copy). google_crc32c's Python entry points
accept only ``bytes``; for other buffers we call the same native library's
``crc32c_extend`` (hardware CRC instructions) through ctypes, found through the
extension module that links it. If that symbol cannot be found (an unusual
platform), we fall back to ``google_crc32c.value(bytes(buf))``: one extra copy,
same result. Never a Python loop.
"""
from __future__ import annotations

import ctypes
import struct

import google_crc32c
import numpy as np

__all__ = ["crc32c", "crc32c_bytes", "NATIVE_BUFFER_CRC"]


def _load_extend():  # -> ctypes function or None
    try:
        from google_crc32c import _crc32c  # the C extension, linked to libcrc32c
        lib = ctypes.CDLL(_crc32c.__file__)
        fn = lib.crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_uint32
    if fn(0, b"123456789", 9) != 0xE3069283:  # the CRC32C check value
        return None
    return fn


_EXTEND = _load_extend()
_SMALL = 16 * 1024
NATIVE_BUFFER_CRC = _EXTEND is not None


def crc32c(buf) -> int:
    """CRC32C of any contiguous bytes-like object (bytes, memoryview, ndarray)."""
    if isinstance(buf, bytes):
        return google_crc32c.value(buf)
    if len(buf) < _SMALL:      # copying is cheaper than the ctypes call set-up
        return google_crc32c.value(bytes(buf))
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if _EXTEND is None or not arr.flags.c_contiguous:
        return google_crc32c.value(np.ascontiguousarray(arr).tobytes())
    return _EXTEND(0, arr.ctypes.data, arr.nbytes)


def crc32c_bytes(buf) -> bytes:
    """The 4-byte big-endian wire form of ``crc32c(buf)`` (Checksum.value)."""
    return struct.pack(">I", crc32c(buf))
