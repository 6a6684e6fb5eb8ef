"""Request ids a worker was told to abort before it held them.

An Abort can overtake the call it ends (two HTTP/2 streams, or a call still queued at the
worker's gate), or come while the worker is still setting the request up. A worker notes such
ids here, and a request of that id that arrives afterwards ends at once instead of running to
`max_tokens` with nobody reading it. Bounded in count and age: an id is remembered for `ttl_s`
seconds, at most `capacity` ids (the oldest forgotten first)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_CAPACITY = 4096
DEFAULT_TTL_S = 120.0  # longer than a call can wait for a worker's gate


class AbortedIds:
    """A set of request ids that forgets each one `ttl_s` seconds after it was added."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError(f"capacity must be >= 1 and ttl_s > 0, got {capacity}, {ttl_s}")
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._expiry: OrderedDict[str, float] = OrderedDict()  # id -> when it is forgotten

    def add(self, request_id: str) -> None:
        self._forget_expired()
        self._expiry[request_id] = self._clock() + self._ttl_s
        self._expiry.move_to_end(request_id)  # the order of expiry: one ttl for all
        while len(self._expiry) > self._capacity:
            self._expiry.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        self._forget_expired()
        return request_id in self._expiry

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._expiry)

    def _forget_expired(self) -> None:
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
