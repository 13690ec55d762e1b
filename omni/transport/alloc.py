"""First-fit slot allocator with coalescing, for one shm segment (pure, no I/O)."""

from __future__ import annotations

import bisect

ALIGN = 64


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class SlotAllocator:
    """Hands out aligned [offset, offset+size) ranges of a `capacity`-byte region."""

    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGN
        self._free_offsets: list[int] = [0]          # sorted
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}
        self.bytes_in_use = 0

    def alloc(self, nbytes: int) -> int | None:
        size = round_up(max(nbytes, 1))
        for i, off in enumerate(self._free_offsets):
            have = self._free_sizes[off]
            if have >= size:
                del self._free_sizes[off]
                if have == size:
                    del self._free_offsets[i]
                else:
                    self._free_offsets[i] = off + size
                    self._free_sizes[off + size] = have - size
                self._used[off] = size
                self.bytes_in_use += size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.bytes_in_use -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        # merge with the following free block
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes.pop(self._free_offsets[i])
            del self._free_offsets[i]
        # merge with the preceding free block
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    def free_blocks(self) -> list[tuple[int, int]]:
        return [(o, self._free_sizes[o]) for o in self._free_offsets]
