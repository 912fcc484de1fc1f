"""cluster/transport.py: ZeroMQ sockets on loopback, CurveZMQ keys and who they let in, `mlx-pd keys`."""

from __future__ import annotations

import logging
import shutil
import stat
import threading

import pytest
import zmq
import zmq.auth

from cluster.launch import cli
from cluster.transport import (
    LOOPBACK, CurveKeys, check_endpoint, client_socket, close_context, generate_keys, server_socket,
)

WAIT_MS = 1000  # how long a refused peer gets to (not) deliver


class Net:
    """One Context plus every socket made through it, all closed (authenticator stopped) by `close`."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []

    def server(self, kind=zmq.ROUTER, **kw):
        sock, endpoint = server_socket(self.ctx, kind, **kw)
        self.sockets.append(sock)
        return sock, endpoint

    def client(self, endpoint, kind=zmq.DEALER, keys=None, **kw):
        sock = client_socket(self.ctx, kind, endpoint, keys, **kw)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
        close_context(self.ctx)
        close_context(self.ctx)  # idempotent


@pytest.fixture
def net():
    n = Net()
    yield n
    n.close()


@pytest.fixture
def keys(tmp_path):
    return generate_keys(tmp_path / "keys")


def offer(sock, frames) -> bool:
    """Send ``frames`` from a peer that may have been refused: True when ZeroMQ queued them, False when the
    refused connection was already dropped and the send deadline passed (either way nothing may arrive)."""
    try:
        sock.send_multipart(frames)
        return True
    except zmq.Again:
        return False


def recv(sock, timeout_ms=5000):
    """The next multipart message, or None when none arrives within timeout_ms."""
    if sock.poll(timeout_ms, zmq.POLLIN):
        return sock.recv_multipart()
    return None


def test_server_binds_loopback_by_default_and_returns_the_real_port(net):
    sock, endpoint = net.server()
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host == LOOPBACK and 0 < int(port) <= 65535
    assert sock.last_endpoint.decode() == endpoint
    assert sock.linger == 0
    c = net.client(endpoint)
    c.send_multipart([b"hi"])
    _, body = recv(sock)
    assert body == b"hi"


def test_curve_client_and_server_exchange_both_ways(net, keys):
    srv, endpoint = net.server(keys=keys)
    assert srv.curve_server
    c = net.client(endpoint, keys=keys)
    c.send_multipart([b"ping", b"payload"])
    identity, *body = recv(srv)
    assert body == [b"ping", b"payload"]
    srv.send_multipart([identity, b"pong"])
    assert recv(c) == [b"pong"]


def test_plain_client_gets_nothing_through_to_a_curve_server(net, keys):
    srv, endpoint = net.server(keys=keys)
    c = net.client(endpoint)  # no keys: NULL mechanism, the handshake fails
    offer(c, [b"injected"])
    assert recv(srv, WAIT_MS) is None


def test_unauthorized_client_key_is_refused_until_its_public_key_is_added(net, keys, tmp_path):
    d = tmp_path / "keys"
    zmq.auth.create_certificates(tmp_path, "extra")  # a stranger's own key pair
    stranger_public, stranger_secret = zmq.auth.load_certificate(tmp_path / "extra.key_secret")
    stranger = CurveKeys(keys.server_public, b"x" * 40, stranger_public, stranger_secret, (stranger_public,))

    srv, endpoint = net.server(keys=keys)
    c = net.client(endpoint, keys=stranger)  # knows the server's public key, but is not authorized
    offer(c, [b"let me in"])
    assert recv(srv, WAIT_MS) is None

    shutil.copy(tmp_path / "extra.key", d / "extra.key")  # the admin authorizes it
    reloaded = CurveKeys.load(d)
    assert set(reloaded.authorized_clients) == {keys.client_public, stranger_public}
    srv2, endpoint2 = net.server(keys=reloaded)
    c2 = net.client(endpoint2, keys=stranger)
    c2.send_multipart([b"let me in"])
    assert recv(srv2)[1:] == [b"let me in"]
    offer(c, [b"still refused"])  # the first server keeps its own, older set
    assert recv(srv, WAIT_MS) is None


def test_a_blocking_send_with_no_connection_gives_up_at_the_send_deadline(net):
    """Every socket made here has a send deadline: a blocking send that has no connection to queue to (nothing
    listens, or the handshake was refused and the connection dropped) raises zmq.Again, it never hangs."""
    import time

    from cluster.transport import SEND_DEADLINE_MS

    _, endpoint = net.server()
    net.sockets[-1].close(linger=0)  # the port is free again: nobody will answer
    c = net.client(endpoint, kind=zmq.PUSH, options={zmq.IMMEDIATE: 1})  # queue only to a finished connection
    start = time.monotonic()
    with pytest.raises(zmq.Again):
        c.send(b"nobody listens")
    assert SEND_DEADLINE_MS / 1000 * 0.9 <= time.monotonic() - start < SEND_DEADLINE_MS / 1000 + 5


def test_probing_a_worker_that_refuses_our_key_answers_none_within_its_timeout(net, keys, tmp_path):
    """probe_worker (what tools and benchmarks ask a worker with) answers a refused handshake with None inside
    its timeout, and the same responder answers an authorized probe with its stats."""
    import time

    from cluster.launch.workers import probe_worker
    from cluster.protocol import PROTOCOL_VERSION, TO_WORKER, Pong, WorkerStats, pack, unpack

    srv, endpoint = net.server(keys=keys)
    stop = threading.Event()

    def answer_pings():
        while not stop.is_set():
            if srv.poll(50):
                identity, frame = srv.recv_multipart()
                ping = unpack(frame, TO_WORKER, PROTOCOL_VERSION)
                srv.send_multipart([identity, pack(Pong(seq=ping.seq, stats=WorkerStats()))], zmq.NOBLOCK)

    responder = threading.Thread(target=answer_pings, daemon=True)
    responder.start()
    try:
        assert probe_worker(endpoint, keys, timeout_s=3.0) is not None
        zmq.auth.create_certificates(tmp_path, "stranger")
        public, secret = zmq.auth.load_certificate(tmp_path / "stranger.key_secret")
        stranger = CurveKeys(keys.server_public, b"x" * 40, public, secret, (public,))
        for _ in range(3):  # early (queued before the refusal) and late (the connection already dropped)
            start = time.monotonic()
            assert probe_worker(endpoint, stranger, timeout_s=1.0) is None
            assert time.monotonic() - start < 1.0 + 1.0
    finally:
        stop.set()
        responder.join(timeout=5)


def test_generate_keys_protects_secrets_and_refuses_to_overwrite(tmp_path):
    d = tmp_path / "keys"
    first = generate_keys(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert first.authorized_clients == (first.client_public,)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        generate_keys(d)
    assert CurveKeys.load(d) == first
    second = generate_keys(d, overwrite=True)
    assert second.server_secret != first.server_secret


def test_load_names_the_missing_file_and_repr_hides_secrets(tmp_path, keys):
    d = tmp_path / "keys"
    text = repr(keys) + str(keys)
    for secret in (keys.server_secret, keys.client_secret):
        assert secret.decode() not in text and secret[:8].decode() not in text
    assert keys.server_public[:8].decode() in text and keys.server_public.decode() not in text

    (d / "client.key_secret").unlink()
    with pytest.raises(ValueError, match=r"client\.key_secret.*mlx-pd keys") as info:
        CurveKeys.load(d)
    assert keys.server_secret.decode() not in str(info.value)
    with pytest.raises(ValueError, match=r"does not exist.*mlx-pd keys"):
        CurveKeys.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="server_secret must be 40"):
        CurveKeys(keys.server_public, b"short", keys.client_public, keys.client_secret, ())


def test_bad_hosts_ports_and_endpoints_are_clear_errors(net):
    with pytest.raises(ValueError, match="port=70000 is invalid"):
        server_socket(net.ctx, zmq.ROUTER, port=70000)
    with pytest.raises(ValueError, match="host='tcp://x' is invalid"):
        server_socket(net.ctx, zmq.ROUTER, host="tcp://x")
    for bad in ("127.0.0.1:5555", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "udp://h:1"):
        with pytest.raises(ValueError, match="invalid"):
            check_endpoint(bad)
    _, endpoint = net.server()
    port = int(endpoint.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match="cannot bind"):
        server_socket(net.ctx, zmq.ROUTER, port=port)  # already in use


def test_binding_beyond_loopback_without_keys_warns(net, keys, caplog):
    with caplog.at_level(logging.WARNING, logger="cluster.transport"):
        net.server(host=LOOPBACK)
        assert caplog.records == []
        net.server(host="0.0.0.0", keys=keys)
        assert caplog.records == []
        net.server(host="0.0.0.0")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "readable and injectable" in record.getMessage() and "mlx-pd keys" in record.getMessage()


def test_cli_keys_writes_the_files_and_prints_the_snippet(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_PD_NO_OPENBLAS", "1")
    d = tmp_path / "cluster-keys"
    assert cli.main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    assert f'[security]\ncurve_keys_dir = "{d}"' in out
    assert "every machine" in out and "secure channel" in out
    keys = CurveKeys.load(d)
    assert keys.server_secret.decode() not in out and keys.client_secret.decode() not in out

    assert cli.main(["keys", str(d)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert cli.main(["keys", str(d), "--force"]) == 0
    assert CurveKeys.load(d).server_public != keys.server_public


def test_close_context_leaves_no_authenticator_thread(tmp_path):
    before = threading.active_count()
    context = zmq.Context()
    sock, _ = server_socket(context, zmq.ROUTER, keys=generate_keys(tmp_path / "k"))
    assert threading.active_count() > before
    sock.close()
    close_context(context)
    assert threading.active_count() == before and context.closed


def test_server_options_reach_the_connections_it_accepts(net, keys):
    """MAXMSGSIZE passed to server_socket bounds what a peer can make it buffer (set after bind, ZeroMQ ignored
    it: the listener copies the options when it binds). Also under CurveZMQ."""
    for curve in (None, keys):
        server, endpoint = net.server(options={zmq.MAXMSGSIZE: 1000}, keys=curve)
        big = net.client(endpoint, keys=curve)
        big.send(b"x" * 5000)
        assert recv(server, WAIT_MS) is None  # the oversized message closed that connection
        small = net.client(endpoint, keys=curve)
        small.send(b"x" * 500)
        assert recv(server)[1] == b"x" * 500


def test_client_heartbeats_notice_a_stopped_server(net, tmp_path):
    """Heartbeat options passed to client_socket apply to its connection (set after connect, ZeroMQ ignored them
    and the router never noticed a SIGSTOPped worker): a server process that stops answering shows as a
    disconnect within the heartbeat timeout, although its TCP connection stays open."""
    import signal
    import subprocess
    import sys
    import time

    from zmq.utils.monitor import recv_monitor_message

    script = ("import sys, zmq\nctx = zmq.Context(); s = ctx.socket(zmq.ROUTER)\n"
              "port = s.bind_to_random_port('tcp://127.0.0.1'); print(port, flush=True)\n"
              "while True: s.send_multipart(s.recv_multipart())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = net.client(f"tcp://127.0.0.1:{port}", options={zmq.HEARTBEAT_IVL: 200, zmq.HEARTBEAT_TIMEOUT: 1000})
        mon = client.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            client.send(b"hi")
            assert recv(client) == [b"hi"]
            proc.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            assert mon.poll(10_000), "no disconnect: the heartbeat options did not apply"
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
            assert time.monotonic() - start < 5
        finally:
            mon.close(linger=0)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
