"""ZeroMQ sockets for every cluster link, with optional CurveZMQ encryption and client authentication.

Every cluster socket (KV transfer, control and token traffic, the KV-event PUB) is made here, so the
security rules live in one place (DESIGN §5):

- servers bind 127.0.0.1 unless told otherwise; binding elsewhere without keys logs a warning;
- with :class:`CurveKeys`, a server socket encrypts (``curve_server``) and accepts only the client
  public keys in ``keys.authorized_clients``, checked by a ZAP handler (one
  ``zmq.auth.thread.ThreadAuthenticator`` per Context, started on first use);
- every socket has ``LINGER 0``, so closing never blocks on unsent messages, and a send deadline
  (``SNDTIMEO`` = :data:`SEND_DEADLINE_MS`), so a blocking send to a peer that refused the handshake, or
  that is gone, raises ``zmq.Again`` instead of waiting forever (the workers and router send with
  ``zmq.NOBLOCK`` anyway; tools, benchmarks and tests send blocking).

Key directory layout (made by ``mlx-pd keys DIR``, i.e. :func:`generate_keys`)::

    DIR/server.key  server.key_secret  client.key  client.key_secret  [NAME.key ...]

Every ``*.key`` public file except ``server.key`` is an authorized client, so an admin adds a client by
dropping its ``NAME.key`` in. Copy DIR to every machine over a secure channel; secrets never appear in
logs, reprs or exceptions.

A Context that made a Curve server socket must be ended with :func:`close_context` (after its sockets
are closed): it stops the authenticator thread, whose socket would otherwise keep ``ctx.term()`` waiting.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SEND_DEADLINE_MS = 2000  # the longest a blocking send on any socket made here waits for a peer to queue to
Z85_KEY_LEN = 40  # a 32-byte Curve25519 key, z85-encoded
_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
PathLike = Union[str, os.PathLike]


def _hint(directory: PathLike) -> str:
    return f"run `mlx-pd keys {directory}` to create the keys"


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """CurveZMQ key material: z85-encoded bytes (40 each), as ``zmq.auth.load_certificate`` returns.

    ``authorized_clients`` are the client public keys a server socket accepts. Construction raises
    ValueError (naming the field, never showing a secret) when a key is not 40 z85 bytes. The repr
    shows only the first 8 characters of the public keys.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized_clients: tuple[bytes, ...]

    def __post_init__(self) -> None:
        named = [(n, getattr(self, n)) for n in ("server_public", "server_secret", "client_public", "client_secret")]
        named += [(f"authorized_clients[{i}]", k) for i, k in enumerate(self.authorized_clients)]
        for name, key in named:
            if not isinstance(key, bytes) or len(key) != Z85_KEY_LEN:
                raise ValueError(f"CurveKeys.{name} must be {Z85_KEY_LEN} z85-encoded bytes")
        object.__setattr__(self, "authorized_clients", tuple(self.authorized_clients))

    def __repr__(self) -> str:
        clients = ", ".join(k[:8].decode("ascii", "replace") + "…" for k in self.authorized_clients)
        return (f"CurveKeys(server_public={self.server_public[:8].decode('ascii', 'replace')}…, "
                f"client_public={self.client_public[:8].decode('ascii', 'replace')}…, "
                f"authorized_clients=[{clients}], secrets=<hidden>)")

    __str__ = __repr__

    @classmethod
    def load(cls, directory: PathLike) -> "CurveKeys":
        """Read DIR/server.key_secret, DIR/client.key_secret and every DIR/*.key but server.key.

        Raises ValueError naming the missing or unreadable file (or saying no client key is authorized)
        and telling to run ``mlx-pd keys DIR``.
        """
        d = Path(directory).expanduser()
        if not d.is_dir():
            raise ValueError(f"CurveZMQ key directory {d} does not exist; {_hint(d)}")

        def pair(name: str) -> tuple[bytes, bytes]:
            path = d / name
            try:
                public, secret = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read CurveZMQ key file {path} ({type(exc).__name__}); {_hint(d)}") from None
            if secret is None:
                raise ValueError(f"CurveZMQ key file {path} holds no secret key; {_hint(d)}")
            return public, secret

        server_public, server_secret = pair("server.key_secret")
        client_public, client_secret = pair("client.key_secret")
        authorized = []
        for path in sorted(d.glob("*.key")):
            if path.name == "server.key":
                continue
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read CurveZMQ public key file {path} ({type(exc).__name__}); "
                                 f"fix or remove it, or {_hint(d)}") from None
            if public not in authorized:
                authorized.append(public)
        if not authorized:
            raise ValueError(f"no client public key (*.key other than server.key) in {d}; {_hint(d)}")
        try:
            return cls(server_public, server_secret, client_public, client_secret, tuple(authorized))
        except ValueError as exc:
            raise ValueError(f"bad key in {d}: {exc}; {_hint(d)}") from None


def generate_keys(directory: PathLike, overwrite: bool = False) -> CurveKeys:
    """Create the server and client key pairs in ``directory`` (made 0o700; secret files 0o600).

    Raises FileExistsError when any of server.key[_secret] / client.key[_secret] already exists and
    ``overwrite`` is False. Extra ``NAME.key`` client files are left as they are. Returns the loaded keys.
    """
    d = Path(directory)
    existing = [n for n in _FILES if (d / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{d} already holds CurveZMQ keys ({', '.join(existing)}); refusing to overwrite "
                              f"them (use --force / overwrite=True to replace them, then copy the new keys to "
                              f"every machine)")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # before writing secrets, so they are never readable by others, even briefly
    for name in ("server", "client"):
        zmq.auth.create_certificates(d, name)
        os.chmod(d / f"{name}.key_secret", 0o600)
    return CurveKeys.load(d)


class _ContextAuth:
    """The ZAP authenticator of one Context; each distinct set of authorized keys gets its own ZAP domain."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        self.auth.start()

    def domain_for(self, authorized: tuple[bytes, ...]) -> str:
        allowed = frozenset(authorized)
        domain = "mlx-pd-" + hashlib.sha256(b"".join(sorted(allowed))).hexdigest()[:16]
        if domain not in self.auth.credentials_providers:
            self.auth.configure_curve_callback(domain, _Allowed(allowed))
        return domain


class _Allowed:
    """ZAP credentials provider: accepts exactly the given z85 client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_AUTH: dict[int, tuple[zmq.Context, _ContextAuth]] = {}
_AUTH_LOCK = threading.Lock()


def _auth_for(ctx: zmq.Context) -> _ContextAuth:
    with _AUTH_LOCK:
        entry = _AUTH.get(id(ctx))
        if entry is None:
            entry = _AUTH[id(ctx)] = (ctx, _ContextAuth(ctx))
        return entry[1]


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback IPs (127.0.0.0/8, ::1); False for "*", 0.0.0.0 and the rest."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_port(port: object, what: str, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ValueError(f"{what} port={port!r} is invalid: use an integer in {low}..65535"
                         + (" (0 picks a free port)" if allow_zero else ""))
    return port


def _bind_host(host: object) -> tuple[str, bool]:
    """(host as written in a tcp:// endpoint, is IPv6); ValueError for anything else."""
    if not isinstance(host, str) or not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"bind host={host!r} is invalid: give an IP address, an interface name or '*' "
                         f"(default {LOOPBACK})")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bind host={host!r} is invalid: give the address without a port or scheme") from None
        return f"[{host}]", True
    return host, False


def check_endpoint(endpoint: object) -> str:
    """Validate a connect endpoint: ``tcp://HOST:PORT`` (port 1..65535), ``ipc://PATH`` or ``inproc://NAME``."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"endpoint {endpoint!r} is invalid: expected tcp://HOST:PORT")
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc") and rest:
        return endpoint
    if scheme != "tcp":
        raise ValueError(f"endpoint {endpoint!r} is invalid: the scheme must be tcp (or ipc/inproc)")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or any(c.isspace() or c == "/" for c in host) or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is invalid: expected tcp://HOST:PORT")
    _check_port(int(port), f"endpoint {endpoint!r}:", allow_zero=False)
    return endpoint


def server_socket(ctx: zmq.Context, kind: int, host: str = LOOPBACK, port: int = 0,
                  keys: Optional[CurveKeys] = None, options: Optional[dict[int, int]] = None) -> tuple[zmq.Socket, str]:
    """Create a ``kind`` socket (zmq.ROUTER, zmq.PUB, ...) and bind it to tcp://host:port.

    ``port`` 0 picks a free port. With ``keys`` the socket is a Curve server that accepts only
    ``keys.authorized_clients``. ``options`` ({zmq.MAXMSGSIZE: n, ...}) are set before binding: the listener
    copies the socket's options when it binds, so an option set afterwards never reaches the connections it
    accepts (checked in tests/test_transport.py); they may override the send deadline. Returns (socket, "tcp://host:actual_port"). Raises
    ValueError for a bad host or port, or when binding fails (address in use, no such interface); the socket
    is then closed.
    """
    _check_port(port, "bind", allow_zero=True)
    addr_host, ipv6 = _bind_host(host)
    if keys is None and not is_loopback(host):
        log.warning("binding tcp://%s:%s without CurveZMQ keys: KV blocks and requests on this socket are "
                    "readable and injectable by anyone on the network; create keys with `mlx-pd keys DIR` and "
                    "set [security] curve_keys_dir in the topology", addr_host, port or "*")
    sock = ctx.socket(kind)
    try:
        sock.linger = 0
        sock.sndtimeo = SEND_DEADLINE_MS
        if ipv6:
            sock.ipv6 = True
        if keys is not None:
            sock.zap_domain = _auth_for(ctx).domain_for(keys.authorized_clients).encode()
            sock.curve_server = True
            sock.curve_publickey = keys.server_public
            sock.curve_secretkey = keys.server_secret
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{addr_host}")
        else:
            sock.bind(f"tcp://{addr_host}:{port}")
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"cannot bind tcp://{addr_host}:{port or '*'}: {exc.strerror} "
                         f"(choose another host or port; port 0 picks a free one)") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, f"tcp://{addr_host}:{port}"


def client_socket(ctx: zmq.Context, kind: int, endpoint: str, keys: Optional[CurveKeys] = None,
                  options: Optional[dict[int, int]] = None) -> zmq.Socket:
    """Create a ``kind`` socket and connect it to ``endpoint`` (see :func:`check_endpoint`).

    With ``keys`` it is a Curve client: it checks the server's public key and presents
    ``keys.client_public``. Connecting is asynchronous: a refused handshake delivers nothing, it does not raise;
    once ZeroMQ drops the refused connection, a blocking send raises ``zmq.Again`` after SEND_DEADLINE_MS.
    ``options`` ({zmq.SNDHWM: 4, zmq.HEARTBEAT_IVL: 1000, ...}) are set before connecting: ZeroMQ applies
    high-water marks and heartbeats to connections made after they are set, never to an existing one
    (libzmq's zmq_setsockopt(3): "subsequent ... connections").
    """
    check_endpoint(endpoint)
    sock = ctx.socket(kind)
    try:
        sock.linger = 0
        sock.sndtimeo = SEND_DEADLINE_MS
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if endpoint.startswith("tcp://["):
            sock.ipv6 = True
        if keys is not None:
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"cannot connect to {endpoint}: {exc.strerror}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def close_context(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s authenticator thread (if one was started), then close whatever sockets are left and
    terminate ``ctx`` without lingering. Idempotent.

    Call it only once every thread that used the context's sockets has stopped: closing a ZeroMQ socket while
    another thread uses it corrupts memory (the authenticator's socket is why it is stopped first).
    """
    with _AUTH_LOCK:
        entry = _AUTH.pop(id(ctx), None)
    if entry is not None:
        entry[1].auth.stop()
    if not ctx.closed:
        ctx.destroy(linger=0)
