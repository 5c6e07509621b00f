"""Who waits behind whom: the requests vLLM has not scheduled yet, in its order.

The gate weighs a recompute by the requests it delays (decision 0079). Those
are the requests scheduled after it, not every request waiting: the ones
ahead of it are scheduled first whatever it costs. Counting every other
waiting request made the preloader and the lookup disagree about the same
request: a request that arrived third of three was preloaded with two others
"waiting", and when its turn came the two ahead had been scheduled, its
lookup counted none and recomputed what had just been read (decision 0070).
Counted behind it, the number can only grow between the preload and the
lookup (later arrivals join the tail), and staged chunks cost less than the
reads the preload priced, so a lookup never recomputes a prefix its
preload chose to read.

vLLM's waiting queue is FIFO by arrival and a preempted request goes back to
its front; the priority policy reorders it, which this does not model (it
then counts by arrival).
"""

from __future__ import annotations

import itertools


class WaitingQueue:
    """Requests arrived or preempted and not scheduled yet, each with its place."""

    def __init__(self) -> None:
        self._place: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._fronts = itertools.count(-1, -1)  # preempted: ahead of every arrival

    def arrived(self, req_id: str) -> None:
        self._place.setdefault(req_id, next(self._arrivals))

    def preempted(self, req_id: str) -> None:
        """Back at the front of the queue (vLLM prepends preempted requests)."""
        self._place[req_id] = next(self._fronts)

    def left(self, req_id: str) -> None:
        """Scheduled or finished."""
        self._place.pop(req_id, None)

    def behind(self, req_id: str) -> int:
        """Requests that will be scheduled after ``req_id``; all of them for a
        request not in the queue (one that arrives now joins the tail)."""
        place = self._place.get(req_id)
        if place is None:
            return len(self._place)
        # Linear: queues are hundreds at most, and this runs once per request decision.
        return sum(1 for p in self._place.values() if p > place)
