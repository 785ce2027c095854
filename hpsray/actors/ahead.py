"""A batch's inputs fetched ahead and its rows handed back off the training thread
(docs/architecture.md: The pipeline).

While batch ``t`` trains, the trainer actor's second thread (Ray concurrency group
:data:`AHEAD_GROUP`, one thread) fetches ``t+1``'s inputs from the object store, then the keys
of the batch after it, so the training thread starts ``t+1`` on values instead of waiting for
them. A third thread (:data:`RETURNS_GROUP`) hands each batch's rows back to their owners
(``Trainer.returned``): the training thread leaves them in a :class:`Handover` and its call
returns at once, so storing them in the object store (milliseconds for megabytes) overlaps the
next batch's training instead of preceding it.

:class:`Ahead` holds the fetches by batch id: :meth:`Ahead.start` registers one (the fetching
thread), :meth:`Ahead.take` hands it to ``train`` (or ``None``: none was started, and ``train``
fetches its inputs itself, as without this module) and forgets fetches of earlier batches that
no ``train`` took (a failed batch, a recovery).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

__all__ = ["AHEAD_GROUP", "RETURNS_GROUP", "Ahead", "Fetch", "Handover", "trainer_actor"]

AHEAD_GROUP = "ahead"
"""The trainer actor's concurrency group of ``Trainer.fetch_ahead``: one thread beside the one
that trains (every other method runs on that one, in call order)."""


RETURNS_GROUP = "returns"
"""The concurrency group of ``Trainer.returned``: one thread that stores each batch's rows."""


def trainer_actor(cls: type) -> Any:
    """``cls`` (the trainer) as a Ray actor class with its :data:`AHEAD_GROUP` and
    :data:`RETURNS_GROUP` threads."""
    import ray

    return ray.remote(concurrency_groups={AHEAD_GROUP: 1, RETURNS_GROUP: 1})(cls)  # type: ignore[call-overload]


class Fetch:
    """One batch's fetch: its inputs (:meth:`inputs`) and the next batch's keys
    (:meth:`upcoming`), each set once by the fetching thread, read by the training thread."""

    def __init__(self) -> None:
        self._inputs: Future = Future()
        self._upcoming: Future = Future()

    def run(self, inputs: Callable[[], Any], upcoming: Callable[[], Any]) -> None:
        """Fetch both, in order; an error is kept for the reader (never raised here)."""
        for future, fetch in ((self._inputs, inputs), (self._upcoming, upcoming)):
            try:
                future.set_result(fetch())
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                future.set_exception(e)

    def inputs(self) -> Any:
        """The batch's inputs (waits for the fetch; raises its error)."""
        return self._inputs.result()

    def upcoming(self) -> Any:
        """The next batch's keys (waits for the fetch; raises its error)."""
        return self._upcoming.result()


class Ahead:
    """The fetches under way or done, by batch id, in the order they started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fetches: OrderedDict[Hashable, Fetch] = OrderedDict()

    def start(self, batch_id: Hashable) -> Fetch:
        fetch = Fetch()
        with self._lock:
            self._fetches[batch_id] = fetch
        return fetch

    def take(self, batch_id: Hashable) -> Fetch | None:
        """The fetch of ``batch_id`` (``None``: none started); fetches started before it are
        dropped (their batches will not train)."""
        with self._lock:
            if batch_id not in self._fetches:
                return None
            while True:
                b, fetch = self._fetches.popitem(last=False)
                if b == batch_id:
                    return fetch

    def clear(self) -> None:
        with self._lock:
            self._fetches.clear()


class Handover:
    """Each batch's rows to return, by batch id: the training thread :meth:`give` s them (or the
    error that stopped the batch), the returning thread :meth:`take` s them, whichever comes
    first creating the entry. The driver calls ``returned(t)`` with every ``train(t)``, so every
    entry is taken; :meth:`clear` (a reset after a failure) forgets any that were not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, Future] = {}

    def _entry(self, batch_id: Hashable) -> Future:
        with self._lock:
            return self._entries.setdefault(batch_id, Future())

    def give(self, batch_id: Hashable, value: Any = None, error: BaseException | None = None) -> None:
        entry = self._entry(batch_id)
        if error is not None:
            entry.set_exception(error)
        else:
            entry.set_result(value)

    def take(self, batch_id: Hashable) -> Any:
        """The rows of ``batch_id`` (waits for the batch's end; raises its error)."""
        entry = self._entry(batch_id)
        try:
            return entry.result()
        finally:
            with self._lock:
                self._entries.pop(batch_id, None)

    def clear(self) -> None:
        """Forget the rows given and never taken (a take under way keeps waiting for its batch)."""
        with self._lock:
            self._entries = {b: f for b, f in self._entries.items() if not f.done()}

    def __len__(self) -> int:
        return len(self._entries)
