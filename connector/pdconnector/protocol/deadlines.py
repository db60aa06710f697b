"""A min-heap of (deadline, key) with lazy invalidation, shared by the prefill and decode tables.

Tables push a key whenever one of its deadlines is set and, when ``due`` hands the key
back, re-check the entry's real deadlines themselves: a stale heap item only costs a
re-check, so deadlines can move without searching the heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()

    def push(self, deadline: float, key: K) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), key))

    def due(self, now: float) -> Iterator[K]:
        """Pop the keys whose deadline is ``<= now`` (a key may come back more than once)."""
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)[2]

    def earliest(self) -> float | None:
        """A lower bound of the next real deadline (stale items can make it early, never late)."""
        return self._heap[0][0] if self._heap else None

    def compact(self, is_live: Callable[[K], bool], live_count: int) -> None:
        """Drop items of dead keys once they outnumber the live ones, so the heap stays proportional to the
        table."""
        if len(self._heap) > 4 * live_count + 64:
            self._heap = [item for item in self._heap if is_live(item[2])]
            heapq.heapify(self._heap)
