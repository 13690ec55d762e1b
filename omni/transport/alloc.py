"""First-fit slot allocation with coalescing, and the keyed slots of a producer's arena (pure, no I/O)."""

from __future__ import annotations

import bisect

ALIGN = 64


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class SlotAllocator:
    """Hands out aligned [offset, offset+size) ranges of a `capacity`-byte region."""

    def __init__(self, capacity: int, align: int = ALIGN):
        self.align = align
        self.capacity = capacity - capacity % align
        self._free_offsets: list[int] = [0]          # sorted
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}
        self.bytes_in_use = 0

    def alloc(self, nbytes: int) -> int | None:
        size = round_up(max(nbytes, 1), self.align)
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


class KeyedSlots:
    """A producer arena's bookkeeping: up to `max_segments` segments of `segment_bytes`, each
    with a SlotAllocator; every reserved slot gets a producer-unique key and an owner (the
    request it belongs to). The caller makes segment i's memory when `reserve` first returns i."""

    def __init__(self, segment_bytes: int, max_segments: int, align: int = ALIGN):
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.align = align
        self.allocs: list[SlotAllocator] = []
        self.slots: dict[int, tuple[int, int, str]] = {}   # key -> (segment, offset, owner)
        self._by_owner: dict[str, set[int]] = {}
        self._next_key = 1

    def reserve(self, need: int, owner: str) -> tuple[int, int, int] | None:
        """(segment, offset, key) of a new slot of `need` bytes; None when every segment is full
        and no more may be added."""
        for index, alloc in enumerate(self.allocs):
            off = alloc.alloc(need)
            if off is not None:
                return self._keep(index, off, owner)
        if len(self.allocs) >= self.max_segments:
            return None
        self.allocs.append(SlotAllocator(self.segment_bytes, self.align))
        off = self.allocs[-1].alloc(need)
        return None if off is None else self._keep(len(self.allocs) - 1, off, owner)

    def _keep(self, index: int, off: int, owner: str) -> tuple[int, int, int]:
        key = self._next_key
        self._next_key += 1
        self.slots[key] = (index, off, owner)
        self._by_owner.setdefault(owner, set()).add(key)
        return index, off, key

    def release(self, keys: list[int]) -> list[tuple[int, int, int]]:
        """Free the slots of `keys`; (key, segment, offset) of each one that was held. Unknown
        or already freed keys are skipped: freeing is idempotent."""
        freed = []
        for key in keys:
            slot = self.slots.pop(key, None)
            if slot is None:
                continue
            index, off, owner = slot
            self.allocs[index].free(off)
            owned = self._by_owner.get(owner)
            if owned is not None:
                owned.discard(key)
                if not owned:
                    del self._by_owner[owner]
            freed.append((key, index, off))
        return freed

    def drop_segment(self, key: int) -> None:
        """Undo the `reserve` of `key` that added the last segment, whose memory could not be made."""
        self.release([key])
        self.allocs.pop()

    def keys_of(self, owner: str) -> list[int]:
        return list(self._by_owner.get(owner, ()))

    def bytes_in_use(self) -> int:
        return sum(a.bytes_in_use for a in self.allocs)

    def clear(self) -> None:
        self.slots.clear()
        self._by_owner.clear()
