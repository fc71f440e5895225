"""In-memory CRC32C per block of each logical file, recorded on write and checked on read.

A block is ``block_size`` bytes of the logical file at a multiple of ``block_size``; each
request piece lies within one block. A write records the CRC of the exact extent it wrote
(replacing whatever the block had); a read is verified when it reads exactly that extent.
Reads of other extents of the block are not verified (the CRC would not apply). Requests in
flight at the same time on overlapping ranges have no defined order, checksummed or not.
"""

from __future__ import annotations

import threading


class CrcStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._crcs: dict[tuple, tuple[int, int, int]] = {}

    @staticmethod
    def key(file_key, block: int, offset: int, length: int) -> tuple:
        return (file_key, block, offset, length)

    def expected(self, key: tuple) -> int | None:
        file_key, block, offset, length = key
        with self._lock:
            entry = self._crcs.get((file_key, block))
        if entry is None or entry[0] != offset or entry[1] != length:
            return None
        return entry[2]

    def record(self, key: tuple, crc: int | None) -> None:
        """Store the CRC of a completed write (None: the write failed, forget the block)."""
        file_key, block, offset, length = key
        with self._lock:
            if crc is None:
                self._crcs.pop((file_key, block), None)
            else:
                self._crcs[(file_key, block)] = (offset, length, crc)

    def forget(self, file_key) -> None:
        with self._lock:
            for k in [k for k in self._crcs if k[0] == file_key]:
                del self._crcs[k]
