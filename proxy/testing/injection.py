"""A fault in force for a block: ``with``, ``async with``, or as a decorator (Toxiproxy's test blocks).

:class:`Injection` adds a :class:`~proxy.testing.faults.Fault`'s rules through the
admin API when the block starts and removes them when it ends — whether it returns,
raises, or is cancelled — so a failing test leaves no rule behind.  Steps that
start later (``timeout(ms)``, ``reset_peer(timeout_ms)``, ``starting_after``) are
added by a timer that the end of the block cancels.  :attr:`Injection.hits` is the
number of frames the fault's rules acted on: live inside the block, frozen at the
value read just before removal afterwards.

The same object is a decorator (``@tap.inject(fault)``), for plain and ``async``
functions: each call runs inside its own activation.  ``async with`` does the HTTP
calls in a worker thread (Trio or asyncio, found by ``sniffio``) so the event loop
keeps running; the removal finishes even when the task is cancelled.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from proxy.testing.errors import AdminError, RuleNotFound, TapError
from proxy.testing.faults import Fault

if TYPE_CHECKING:
    from proxy.testing.admin_client import AdminClient

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


async def run_blocking(fn: Callable[[], R], *, finish: bool = False) -> R:
    """Run ``fn`` in a worker thread of the running Trio or asyncio loop (inline under anything else).

    With ``finish`` the call completes even if the task is cancelled meanwhile (cleanup).
    """
    import sniffio

    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return fn()
    if library == "trio":
        import trio

        if finish:
            with trio.CancelScope(shield=True):
                return await trio.to_thread.run_sync(fn)
        return await trio.to_thread.run_sync(fn)
    if library == "asyncio":
        import asyncio

        if finish:
            return await asyncio.shield(asyncio.to_thread(fn))
        return await asyncio.to_thread(fn)
    return fn()


class Injection:
    """One fault, added on entry and removed on exit; see the module docstring."""

    def __init__(self, admin: AdminClient | Callable[[], AdminClient], fault: Fault, *,
                 name: str | None = None) -> None:
        # a function when the tap is not started yet (``@TAP.inject(...)`` at import time)
        self._admin = admin
        self.fault = fault
        self._fixed_name = name
        #: the first rule's name in the current (or last) activation
        self.name: str | None = None
        self._names: list[str] = []
        self._added: list[str] = []
        self._timers: list[threading.Timer] = []
        self._late_error: AdminError | None = None
        self._final_hits: dict[str, int] | None = None
        self._active = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "in force" if self._active else "not in force"
        return f"<Injection {self.name or '?'} {state}: {self.fault!r}>"

    @property
    def admin(self) -> AdminClient:
        return self._admin() if callable(self._admin) else self._admin

    # -- activation -----------------------------------------------------------------------------------------
    def __enter__(self) -> Injection:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop(exc)

    async def __aenter__(self) -> Injection:
        await run_blocking(self.start)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await run_blocking(lambda: self.stop(exc), finish=True)

    def start(self) -> None:
        """Put the fault in force (the rules of its first step now, later steps on timers)."""
        steps = self.fault.steps(self._fixed_name)  # validated before anything is sent
        with self._lock:
            if self._active:
                raise TapError(f"{self.name} is already in force: an injection is entered once at a time")
            self._active = True
            self.name = str(steps[0][1]["name"])
            self._names = [str(rule["name"]) for _, rule in steps]
            self._added, self._timers, self._late_error, self._final_hits = [], [], None, None
        try:
            for after, rule in steps:
                if after <= 0:
                    self._add(rule)
                else:
                    timer = threading.Timer(after, self._add_later, (rule,))
                    timer.daemon = True
                    self._timers.append(timer)
                    timer.start()
        except BaseException:
            self.stop(None, quiet=True)
            raise

    def _add(self, rule: dict[str, Any]) -> None:
        self.admin.add_rule(rule)
        self._added.append(str(rule["name"]))

    def _add_later(self, rule: dict[str, Any]) -> None:
        with self._lock:
            if not self._active:
                return
            try:
                self._add(rule)
            except AdminError as exc:
                self._late_error = exc

    def stop(self, pending: BaseException | None = None, *, quiet: bool = False) -> None:
        """Remove the fault's rules (reading their hits first).

        If removal fails while ``pending`` (the block's own exception) propagates, the
        failure is attached to it as a note instead of replacing it.
        """
        with self._lock:
            if not self._active:
                return
            self._active = False
            for timer in self._timers:
                timer.cancel()
            added = list(self._added)
        problems: list[str] = []
        try:
            admin = self.admin
        except TapError:  # the tap was closed inside the block: its rules went with its proxy
            self._final_hits = dict.fromkeys(self._names, 0)
            return
        try:
            hits = admin.hits()
            self._final_hits = {name: hits.get(name, 0) for name in self._names}
        except AdminError as exc:
            self._final_hits = dict.fromkeys(self._names, 0)
            problems.append(f"could not read the hits of {self.name}: {exc}")
        for name in added:
            try:
                admin.remove_rule(name)
            except RuleNotFound:
                pass  # removed by someone else (a reset between tests, the CLI)
            except AdminError as exc:
                problems.append(f"could not remove rule {name}: {exc}")
        if self._late_error is not None:
            problems.append(f"could not add a later step of {self.name}: {self._late_error}")
        if not problems or quiet:
            return
        if pending is not None:
            for problem in problems:
                pending.add_note(f"pulsar-tap: {problem}")
            return
        raise TapError("; ".join(problems))

    # -- what it did ----------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._active

    @property
    def rule_names(self) -> list[str]:
        """The names of the rules of the current (or last) activation, first step first."""
        return list(self._names)

    @property
    def hits_by_rule(self) -> dict[str, int]:
        if self._active or self._final_hits is None:
            hits = self.admin.hits() if self._names else {}
            return {name: hits.get(name, 0) for name in self._names}
        return dict(self._final_hits)

    @property
    def hits(self) -> int:
        """Frames the fault's rules acted on (live in the block; as removed after it)."""
        return sum(self.hits_by_rule.values())

    # -- as a decorator -------------------------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async with self:
                    return await fn(*args, **kwargs)

            return cast(F, run_async)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return cast(F, run)


__all__ = ["Injection", "run_blocking"]
