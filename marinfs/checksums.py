"""CRC-32C of any memory, in C and without the interpreter lock: google-crc32c's own
``crc32c_extend(crc, pointer, length)`` through ctypes (its extension takes only ``bytes``, so a
checksum of a reused buffer would otherwise cost a copy). None where the C library is missing.

Used by the upload path (part checksums) and the chunk cache (chunk names, in place).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _load() -> Callable[[int, int, int], int] | None:
    try:
        import google_crc32c
        from google_crc32c import _crc32c as ext

        if google_crc32c.implementation != "c":
            return None
        fn = ctypes.CDLL(ext.__file__).crc32c_extend  # found in the library the extension links
        fn.argtypes, fn.restype = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_uint32
        if fn(0, b"123456789", 9) != 0xE3069283:  # the CRC-32C check value
            return None
        return fn
    except (ImportError, OSError, AttributeError):  # pragma: no cover - then MD5 is the only check
        return None


crc32c_extend: Callable[[int, int, int], int] | None = _load()
