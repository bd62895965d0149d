"""``Tap``: a pulsar-tap proxy a test starts in front of a service URL or of an embedded cluster.

A tap is the whole proxy (:func:`~proxy.server.stack.running_proxy`: rules engine,
admin API on a free loopback port, optional recorder) plus a capture observer for
:meth:`Tap.recording`.  It runs either in this process, on a Trio loop of its own in
a daemon thread (:class:`TapServer`, the default: fast to start, nothing to clean
up), or in a child process (``process=True``, :class:`TapProcess`: the same server
in ``python -m proxy.testing.tap_process``, driven over its stdin/stdout; the proxy
then shares no interpreter lock with the test).  Either way rules go through the
admin API (:class:`~proxy.testing.admin_client.AdminClient`), so what a test does
through a tap is what an operator does through ``pulsar-tap rules``.

Without an upstream, a tap starts an :class:`~proxy.testing.cluster.EmbeddedCluster`
of ``brokers`` brokers of its own and stops it on :meth:`Tap.close`.  An upstream is
a ``pulsar://`` URL or anything with a ``service_url`` attribute (an embedded
cluster, a real broker's fixture).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, Self

from proxy.native_threads import ONE_THREAD_LIBRARIES
from proxy.testing.admin_client import AdminClient, RuleLike, RuleStatus
from proxy.testing.capture import Capture, CaptureObserver, CaptureWindow
from proxy.testing.cluster import EmbeddedCluster
from proxy.testing.errors import TapError
from proxy.testing.faults import Fault
from proxy.testing.injection import Injection, run_blocking

if TYPE_CHECKING:
    from proxy.server.observer_hub import ObserverHub

DEFAULT_START_TIMEOUT: Final = 30.0
#: how long the end of a capture waits for the proxy's observers to catch up with the block
_CAPTURE_SETTLE_SECONDS: Final = 5.0


class HasServiceUrl(Protocol):
    @property
    def service_url(self) -> str: ...


@dataclass(frozen=True)
class TapSettings:
    """What a tap's proxy needs (the token travels separately, never on a command line)."""

    upstream: str
    host: str = "127.0.0.1"
    lookup: str = "rewrite"
    advertise: str | None = None
    record_dir: str | None = None
    drain_seconds: float = 0.5

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TapSettings:
        return cls(**data)


class TapBackend(Protocol):
    """A running tap proxy: in this process or a child."""

    service_url: str
    admin_url: str

    def capture_begin(self) -> int: ...

    def capture_end(self, window_id: int) -> CaptureWindow: ...

    def close(self) -> None: ...


class TapServer:
    """The tap's proxy in this process (see the module docstring)."""

    def __init__(self, settings: TapSettings, token: str | None = None) -> None:
        from proxy.config.proxy_config import AdminConfig, HostPort, LimitsConfig, ProxyConfig, RecordConfig, ServiceUrl
        from proxy.server.threaded import ThreadedStack

        self.settings = settings
        try:
            upstream = ServiceUrl.parse(settings.upstream)
        except ValueError as exc:
            raise TapError(f"upstream: {exc}") from None
        self._secrets: tempfile.TemporaryDirectory[str] | None = None
        token_file = None
        if token is not None:  # the admin API reads its token from a file only the user can read
            self._secrets = tempfile.TemporaryDirectory(prefix="pulsar-tap-")
            path = Path(self._secrets.name) / "admin-token"
            path.touch(mode=0o600)
            path.write_text(token, encoding="utf-8")
            token_file = str(path)
        self.config = ProxyConfig(
            upstream=upstream, listen=HostPort(settings.host, 0), advertise=settings.advertise,
            lookup=settings.lookup, admin=AdminConfig(HostPort(settings.host, 0), token_file),
            record=RecordConfig(dir=settings.record_dir) if settings.record_dir else None,
            limits=LimitsConfig(drain_seconds=settings.drain_seconds))
        self.observer = CaptureObserver()
        self._hub_drops: dict[int, int] = {}
        self.thread = ThreadedStack(self.config, observers=[self.observer], name="pulsar-tap")
        self.service_url = ""
        self.admin_url = ""

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        try:
            self.thread.start(timeout)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.thread.stop()
            self._cleanup()
            raise TapError(f"the tap did not start: {exc}") from None
        stack = self.thread.stack
        assert stack is not None and stack.admin_address is not None
        self.service_url = self.thread.service_url
        self.admin_url = f"http://{stack.admin_address}"

    @property
    def recording_path(self) -> Path | None:
        stack = self.thread.stack
        return None if stack is None else stack.recording_path

    def _hub(self) -> ObserverHub | None:
        stack = self.thread.stack
        return None if stack is None else stack.server.observers

    def capture_begin(self) -> int:
        hub = self._hub()
        window_id = self.observer.begin()
        self._hub_drops[window_id] = 0 if hub is None else hub.dropped
        return window_id

    def capture_end(self, window_id: int) -> CaptureWindow:
        end_ns = time.time_ns()
        hub = self._hub()
        deadline = time.monotonic() + _CAPTURE_SETTLE_SECONDS
        # Observers are fed through a queue: wait until what the block caused has been delivered.
        while hub is not None and time.monotonic() < deadline:
            if self.observer.last_ts_ns >= end_ns or self.thread.call(lambda: hub.queued) == 0:
                break
            time.sleep(0.005)
        window = self.observer.end(window_id, end_ns)
        # events the proxy's observer queue had no room for never reached the capture either
        lost = (0 if hub is None else hub.dropped) - self._hub_drops.pop(window_id, 0)
        return replace(window, dropped=window.dropped + lost) if lost > 0 else window

    def close(self) -> None:
        try:
            self.thread.stop()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        if self._secrets is not None:
            self._secrets.cleanup()
            self._secrets = None


class TapProcess:
    """The tap's proxy in a child process, driven over JSON lines on its stdin/stdout."""

    def __init__(self, settings: TapSettings, token: str | None = None) -> None:
        self.settings = settings
        self._token = token
        self._process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._log = tempfile.NamedTemporaryFile(prefix="pulsar-tap-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)
        self.service_url = ""
        self.admin_url = ""

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "proxy.testing.tap_process"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1,
            # (numpy's BLAS on one thread, as in pulsar-tap's own server processes, unless the user says otherwise)
            env={**ONE_THREAD_LIBRARIES, **os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._read_lines, name="pulsar-tap-process-reader", daemon=True).start()
        try:
            ready = self._call({"settings": self.settings.to_json(), "token": self._token}, timeout)
        except TapError:
            self.close()
            raise
        self.service_url = str(ready["service_url"])
        self.admin_url = str(ready["admin_url"])

    def _read_lines(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _call(self, request: dict[str, Any], timeout: float = 30.0) -> Any:
        process = self._process
        if process is None or process.stdin is None:
            raise TapError("the tap process is not running")
        with self._lock:
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = self._lines.get(timeout=timeout)
            except (OSError, queue.Empty):
                line = None
            if line is None:
                raise TapError(f"the tap process did not answer{self._log_tail()}")
            answer = json.loads(line)
        if "error" in answer:
            raise TapError(str(answer["error"]))
        return answer["ok"]

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f" (its log, {self.log_path}, ends: {lines[-1]})" if lines else ""

    def capture_begin(self) -> int:
        return int(self._call({"op": "capture_begin"}))

    def capture_end(self, window_id: int) -> CaptureWindow:
        return CaptureWindow.from_json(self._call({"op": "capture_end", "id": window_id}))

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.poll() is None and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                    process.stdin.close()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        finally:
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._log.close()
            if process.returncode == 0:  # the log is kept only when something went wrong
                self.log_path.unlink(missing_ok=True)


def upstream_url(upstream: str | HasServiceUrl) -> str:
    return upstream if isinstance(upstream, str) else upstream.service_url


class Tap:
    """A proxy in front of ``upstream`` for the duration of a test (see the module docstring).

    ``Tap()`` fronts an embedded cluster of ``brokers`` brokers that it owns;
    ``Tap("pulsar://host:6650")`` or ``Tap(cluster)`` fronts what is given.  ``rules``
    and ``seed`` are put in force at start; ``record_dir`` also records all traffic
    there (a recording ``pulsar-tap show`` reads); ``token`` protects the admin API.
    """

    def __init__(self, upstream: str | HasServiceUrl | None = None, *, brokers: int = 1, process: bool = False,
                 token: str | None = None, lookup: str = "rewrite", host: str = "127.0.0.1",
                 advertise: str | None = None, seed: int | None = None, rules: Sequence[RuleLike] = (),
                 record_dir: str | Path | None = None) -> None:
        self._upstream = upstream
        self._brokers = brokers
        self._process = process
        self._token = token
        self._lookup = lookup
        self._host = host
        self._advertise = advertise
        self._seed = seed
        self._initial_rules = list(rules)
        self._record_dir = None if record_dir is None else str(record_dir)
        self.cluster: EmbeddedCluster | None = None
        self._backend: TapBackend | None = None
        self._admin: AdminClient | None = None

    def __repr__(self) -> str:
        if self._backend is None:
            return f"<Tap not started, for {self._upstream or 'an embedded cluster'}>"
        return f"<Tap at {self.service_url} in front of {self.upstream_url}>"

    # -- life -------------------------------------------------------------------------------------------------
    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> Self:
        """Start the proxy (and the embedded cluster it owns); returns the tap."""
        if self._backend is not None:
            return self
        if self._upstream is None:
            self.cluster = EmbeddedCluster(self._brokers).start()
            upstream = self.cluster.service_url
        else:
            upstream = upstream_url(self._upstream)
        settings = TapSettings(upstream=upstream, host=self._host, lookup=self._lookup, advertise=self._advertise,
                               record_dir=self._record_dir)
        backend: TapServer | TapProcess = (TapProcess(settings, self._token) if self._process
                                           else TapServer(settings, self._token))
        try:
            backend.start(timeout)
            self._backend = backend
            self._admin = AdminClient(backend.admin_url, self._token)
            if self._initial_rules or self._seed is not None:
                self._admin.replace_rules(self._initial_rules, seed=self._seed)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the proxy (clients' connections are closed) and the cluster the tap owns."""
        backend, self._backend = self._backend, None
        cluster, self.cluster = self.cluster, None
        try:
            if backend is not None:
                backend.close()
        finally:
            if cluster is not None:
                cluster.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        await run_blocking(self.start)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await run_blocking(self.close, finish=True)

    @property
    def running(self) -> bool:
        return self._backend is not None

    # -- where it is ------------------------------------------------------------------------------------------
    def _running(self) -> TapBackend:
        if self._backend is None:
            raise TapError("the tap is not running: start() it or use it as a context manager")
        return self._backend

    @property
    def service_url(self) -> str:
        """The URL clients use instead of the upstream's (``pulsar://127.0.0.1:PORT``)."""
        return self._running().service_url

    @property
    def admin_url(self) -> str:
        """The admin API (``http://127.0.0.1:PORT``), for ``AdminClient`` or ``pulsar-tap rules --admin``."""
        return self._running().admin_url

    @property
    def upstream_url(self) -> str:
        return upstream_url(self._upstream) if self._upstream is not None else (
            self.cluster.service_url if self.cluster is not None else "")

    @property
    def admin(self) -> AdminClient:
        self._running()
        assert self._admin is not None
        return self._admin

    @property
    def recording_path(self) -> Path | None:
        """The recording directory of this run when started with ``record_dir`` (in-process taps)."""
        backend = self._running()
        return backend.recording_path if isinstance(backend, TapServer) else None

    # -- what tests do with it --------------------------------------------------------------------------------
    def inject(self, fault: Fault, *, name: str | None = None) -> Injection:
        """``with tap.inject(fault) as f:`` / ``async with`` / ``@tap.inject(fault)``: the fault for a block."""
        return Injection(lambda: self.admin, fault, name=name)

    def recording(self) -> Capture:
        """``with tap.recording() as rec:`` — what the block sent and received (read after it)."""
        return Capture(self)

    def capture_begin(self) -> int:
        return self._running().capture_begin()

    def capture_end(self, window_id: int) -> CaptureWindow:
        return self._running().capture_end(window_id)

    def rules(self) -> list[RuleStatus]:
        return self.admin.rules()

    def reset(self) -> None:
        """Remove every rule."""
        self.admin.reset()

    def connections(self) -> list[dict[str, Any]]:
        return self.admin.connections()


__all__ = ["HasServiceUrl", "Tap", "TapBackend", "TapProcess", "TapServer", "TapSettings", "upstream_url"]
