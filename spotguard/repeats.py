"""What comes again and again in the months a daemon runs: errors at every poll or reconnect (a metadata
service that keeps failing, a daemon that keeps refusing the hook), logged when they first come or change,
then once a period; events that come in floods (connections refused at the peer port), logged once a
period per kind with a count of the others; and keys noted per event or per file, of which only the
latest are kept."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class RepeatedErrors:
    """Per source, whether an error is due to be logged: a new or changed one, or the same one last
    logged ``every`` seconds ago or more."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._logged: dict[str, tuple[str, float]] = {}  # source -> (its error last logged, when)

    def due(self, source: str, error: str) -> bool:
        now = time.monotonic()
        last = self._logged.get(source)
        if last is not None and last[0] == error and now - last[1] < self.every:
            return False
        self._logged[source] = (error, now)
        return True

    def clear(self, source: str) -> bool:
        """``source`` works again: its next error is logged at once. Whether it had failed since it
        was last cleared (every failure passes through :meth:`due`, which notes it): the caller's cue
        to say it recovered."""
        return self._logged.pop(source, None) is not None


class RepeatedEvents:
    """Per kind, whether an event is due to be logged: the first at once, then at most one every
    ``every`` seconds. :meth:`due` answers None for an event not to log, else how many of its kind went
    unlogged since the last one logged. At most ``kinds`` kinds are remembered (the newest)."""

    def __init__(self, every: float, kinds: int = 64) -> None:
        self.every = every
        self._kinds: Latest[str, tuple[float, int]] = Latest(kinds)  # kind -> (last logged, unlogged since)

    def due(self, kind: str) -> int | None:
        now = time.monotonic()
        last = self._kinds.get(kind)
        if last is not None and now - last[0] < self.every:
            self._kinds.put(kind, (last[0], last[1] + 1))
            return None
        self._kinds.put(kind, (now, 0))
        return 0 if last is None else last[1]


class Latest(Generic[K, V]):
    """The ``size`` keys used last and their values. Noting a key (:meth:`put`, :meth:`setdefault`)
    makes it the newest; past ``size`` the one noted longest ago goes. A key that comes back after it
    went counts as new."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        """``key``'s value, if it is kept (not noting it)."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self._size:
            self._items.popitem(last=False)
        return value

    def setdefault(self, key: K, default: V) -> V:
        """``key``'s value, ``default`` if it has none; noted either way."""
        return self.put(key, self._items.get(key, default))


__all__ = ["Latest", "RepeatedErrors", "RepeatedEvents"]
