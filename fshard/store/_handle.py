"""Handles for asynchronous put/get, and the optional event log used to prove overlap.

tensornvme has no non-blocking poll: completions are only seen when its engine is synchronized. So a handle is
`in_flight` from submission until someone waits on it (the caller, or the store reaping it before a conflicting
operation), then `done` or `failed`. The state never claims a completion that was not observed.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import copy_of_kept

IN_FLIGHT, DONE, FAILED = "in_flight", "done", "failed"


class EventLog(list):
    """A plain list of (event, key) tuples. Tests append their own ("compute_start", key) entries to it."""

    def record(self, event: str, key: Any) -> None:
        self.append((event, key))


class Handle:
    """Result of an asynchronous store operation. `wait()` returns the value (the tensor for a get, None for a put)
    or raises the operation's error; it may be called any number of times."""

    __slots__ = ("kind", "key", "_finish", "_state", "_value", "_error", "_log", "_on_done", "__weakref__")

    def __init__(self, kind: str, key: Any, finish: Optional[Callable[[], Any]], log: Optional[EventLog] = None):
        self.kind, self.key, self._finish, self._log = kind, key, finish, log
        self._state, self._value, self._error = IN_FLIGHT, None, None
        self._on_done: Optional[Callable[["Handle"], None]] = None  # the store forgets the handle once it is done
        if log is not None:
            log.record(f"{kind}_submitted", key)

    @classmethod
    def completed(cls, kind: str, key: Any, value: Any = None, log: Optional[EventLog] = None) -> "Handle":
        h = cls(kind, key, None, log)
        h._complete(value, None)
        return h

    @classmethod
    def failed(cls, kind: str, key: Any, error: BaseException, log: Optional[EventLog] = None) -> "Handle":
        h = cls(kind, key, None, log)
        h._complete(None, error)
        return h

    @property
    def state(self) -> str:
        return self._state

    def done(self) -> bool:
        """True once completion has been observed (successful or not)."""
        return self._state != IN_FLIGHT

    def _complete(self, value: Any, error: Optional[BaseException]) -> None:
        self._value, self._error = value, error
        self._state = FAILED if error is not None else DONE
        self._finish = None
        if self._log is not None:
            self._log.record(f"{self.kind}_{'failed' if error is not None else 'done'}", self.key)
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(self)

    def reap(self) -> None:
        """Observe completion without raising: the error, if any, is kept for wait()."""
        if self._state != IN_FLIGHT:
            return
        finish = self._finish
        try:
            value = finish() if finish is not None else None
        except BaseException as e:  # noqa: BLE001 - kept and raised (a copy) by wait()
            self._complete(None, e)
        else:
            self._complete(value, None)
        finally:
            self = finish = None  # (the kept error's traceback holds this frame: no way back to the handle)

    def wait(self) -> Any:
        """The operation's value, or its error raised (a copy of the kept one at each call: fs.errors'
        ``copy_of_kept``)."""
        self.reap()
        if self._error is not None:
            raise copy_of_kept(self._error)
        return self._value

    def __repr__(self) -> str:
        return f"Handle({self.kind}, {self.key!r}, {self._state})"
