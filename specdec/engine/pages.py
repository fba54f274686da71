"""Which pages of a KV pool (specdec.engine.kv_pool) are free: sorted, merged free runs, first
fit. A session owns one contiguous run (an extent)."""

from __future__ import annotations

import bisect
import threading


class PoolFull(Exception):
    """No free run of pages is long enough (the caller compacts, evicts, or refuses the call).
    `pages`: the run that was asked for."""

    def __init__(self, message: str, pages: int = 0) -> None:
        super().__init__(message)
        self.pages = pages


class PageAllocator:
    """Free runs of pages, kept sorted and merged; first fit. Pure bookkeeping, no tensors.
    Locked: the model thread takes pages, but an extent goes back on whichever thread drops
    the last reference to its cache (a weakref finalizer: the event loop, a collection)."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._starts: list[int] = [0] if pages else []  # sorted starts of free runs
        self._lengths: dict[int, int] = {0: pages} if pages else {}  # start -> length
        self._lock = threading.Lock()

    @property
    def free_pages(self) -> int:
        with self._lock:
            return sum(self._lengths.values())

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, in order."""
        with self._lock:
            return [(start, self._lengths[start]) for start in self._starts]

    def alloc(self, pages: int) -> int:
        """The first page of a run of `pages` now taken; PoolFull if no free run is that long."""
        if pages < 1:
            raise ValueError(f"an extent has at least one page; asked for {pages}")
        with self._lock:
            for start in self._starts:
                length = self._lengths[start]
                if length >= pages:
                    self._take(start, length, start, pages)
                    return start
            free = sum(self._lengths.values())
        raise PoolFull(f"no free run of {pages} pages ({free} of {self.pages} free, fragmented)", pages)

    def extend(self, start: int, pages: int, more: int) -> bool:
        """Takes the `more` pages right after extent [start, start + pages) if they are free."""
        end = start + pages
        with self._lock:
            length = self._lengths.get(end, 0)
            if length < more:
                return False
            self._take(end, length, end, more)
            return True

    def around(self, start: int, pages: int, need: int) -> int:
        """Where extent [start, start + pages) and the free runs right before and after it hold
        `need` pages: takes the one after as far as needed, then the end of the one before, and
        returns where the run of `need` pages now starts (below `start` by what the one before
        gave). PoolFull, taking nothing, where they hold fewer."""
        end = start + pages
        with self._lock:
            index = bisect.bisect_left(self._starts, start)
            before = self._starts[index - 1] if index else -1
            spare = self._lengths[before] if index and before + self._lengths[before] == start else 0
            after = self._lengths.get(end, 0)
            if pages + spare + after < need:
                free = sum(self._lengths.values())
                raise PoolFull(f"no free run of {need} pages ({free} of {self.pages} free, fragmented)", need)
            upper = min(after, need - pages)
            if upper:
                self._take(end, after, end, upper)
            lower = need - pages - upper
            if lower == spare and lower:  # all of the run before
                self._starts.pop(index - 1)
                del self._lengths[before]
            elif lower:
                self._lengths[before] -= lower
            return start - lower

    def move_down(self, start: int, pages: int) -> int:
        """Moves extent [start, start + pages) to the lowest free run that holds it (its own
        pages, with the free runs next to them, count), and returns where it starts now."""
        with self._lock:
            self._free(start, pages)
            for run in self._starts:  # one holds it: its own run, at worst
                if (length := self._lengths[run]) >= pages:
                    self._take(run, length, run, pages)
                    return run
        raise AssertionError(f"[{start}, {start + pages}) did not fit its own pages")

    def free(self, start: int, pages: int) -> None:
        """Returns [start, start + pages) to the free runs, merged with its neighbours."""
        if pages < 1 or start < 0 or start + pages > self.pages:
            raise ValueError(f"[{start}, {start + pages}) is not an extent of a {self.pages}-page pool")
        with self._lock:
            self._free(start, pages)

    def _free(self, start: int, pages: int) -> None:
        index = bisect.bisect_left(self._starts, start)
        before = self._starts[index - 1] if index else None
        after = self._starts[index] if index < len(self._starts) else None
        if (before is not None and before + self._lengths[before] > start) or (
            after is not None and start + pages > after
        ):
            raise ValueError(f"[{start}, {start + pages}) overlaps a free run: freed twice")
        if after is not None and start + pages == after:  # merge with the run after
            pages += self._lengths.pop(after)
            self._starts.pop(index)
        if before is not None and before + self._lengths[before] == start:  # merge with the run before
            self._lengths[before] += pages
            return
        self._starts.insert(index, start)
        self._lengths[start] = pages

    def _take(self, run: int, length: int, start: int, pages: int) -> None:
        """Takes [start, start + pages) from the front of free run [run, run + length)."""
        index = bisect.bisect_left(self._starts, run)
        self._starts.pop(index)
        del self._lengths[run]
        if length > pages:
            rest = start + pages
            self._starts.insert(index, rest)
            self._lengths[rest] = length - pages
