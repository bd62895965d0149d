"""Connections to brokers (plain or TLS) and the proxy's TLS contexts.

Upstream TLS verifies the broker's certificate against ``tls.upstream_ca`` (the
system's CAs when none is configured) and the broker's host name.  The client-side
context serves ``tls.cert`` / ``tls.key``.  Failures become
:class:`UpstreamUnavailable`, which the relay reports and turns into a closed client
connection (the client retries, as it would with a broker that is down).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl

import trio

from proxy.config.proxy_config import ServiceUrl, TlsConfig
from proxy.errors import ConfigError, PulsarTapError
from proxy.server.transport import SocketTransport, StreamTransport, Transport, tune

CONNECT_TIMEOUT_S = 10.0


class UpstreamUnavailable(PulsarTapError):
    """The broker could not be reached (refused, unresolvable, TLS failure, timeout)."""


def client_side_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The context for clients reaching the proxy over TLS; None when TLS is not served."""
    if tls.cert is None or tls.key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load certificate and key: {exc}", key="tls.cert") from None
    return context


def upstream_context(tls: TlsConfig) -> ssl.SSLContext:
    """The context for TLS connections to brokers, verifying them against ``upstream_ca``."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if tls.upstream_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.upstream_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load CA certificates: {exc}", key="tls.upstream_ca") from None
    return context


async def connect_plain(host: str, port: int) -> socket.socket:
    """A connected non-blocking socket (each resolved address tried in turn)."""
    try:
        # An IP address needs no resolver: read at once (Trio's getaddrinfo would spend a scheduler
        # round a connection finding that out), a name is resolved in Trio's thread.
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
    except socket.gaierror:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot resolve {host}: {exc}") from None
    errors: list[str] = []
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            tune(sock)
            err = sock.connect_ex(address)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
            if err:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
            return sock
        except OSError as exc:
            where = f"{address[0]!s}:{address[1]!s}"
            errors.append(f"{where}: {exc.strerror or exc!s}")
            sock.close()
        except BaseException:
            trio.lowlevel.notify_closing(sock)
            sock.close()
            raise
    raise UpstreamUnavailable(f"cannot connect to {host}:{port}: {'; '.join(errors) or 'no address'}")


async def open_upstream(broker: ServiceUrl, context: ssl.SSLContext | None) -> Transport:
    """Connect to ``broker``; TLS when its URL is pulsar+ssl://."""
    host, port = broker.address.host, broker.address.port
    with trio.move_on_after(CONNECT_TIMEOUT_S) as scope:
        sock = await connect_plain(host, port)
        if not broker.tls:
            return SocketTransport(sock, f"{broker.address}", tuned=True)  # (connect_plain tuned it)
        tls_context = context or ssl.create_default_context()
        stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), tls_context,
                                server_hostname=host)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(stream)
            raise UpstreamUnavailable(f"TLS handshake with {broker.address} failed: "
                                      f"{exc.__cause__ or exc}") from None
        return StreamTransport(stream, f"{broker.address}", sock)
    assert scope.cancelled_caught
    raise UpstreamUnavailable(f"connecting to {broker.address} timed out after {CONNECT_TIMEOUT_S:g}s")
