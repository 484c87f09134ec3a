"""Every close code protocol.md and the README name, as a real WebSocket client sees it from a
real daphne, started both ways protocol.md serves /proto (plain daphne and gradient.serve)."""

import asyncio
import contextlib
import json
import socket
import threading

import pytest
import websockets
from django.db import connection
from websockets.asyncio.client import connect

from gradient.wire.protocol import MAX_FRAME_BYTES
from tests.e2e.conftest import LAUNCHERS, ROOT, VENV_BIN, Processes
from tests.e2e.fleet import q
from tests.e2e.test_worker_sessions import CAPS, bearer
from tests.factories import WorkerFactory
from workers.models import hash_token

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

# The connection dropped without a close frame, as websockets reports it.
NO_CLOSE_FRAME = 1006


@pytest.fixture(scope="module")
def servers(process_env, tmp_path_factory):
    """One server per launcher, shared by the module's tests."""
    procs = Processes(process_env, tmp_path_factory.mktemp("close-codes"))
    yield {launcher: procs.daphne(launcher) for launcher in LAUNCHERS}
    procs.stop()


@pytest.fixture(params=sorted(LAUNCHERS))
def url(request, servers) -> str:
    return servers[request.param]


async def worker(name: str):
    await q(lambda: WorkerFactory(name=name, token_hash=hash_token(f"t-{name}")))


@contextlib.asynccontextmanager
async def session(url: str, name: str):
    """An open session of worker NAME, past its InitAck."""
    # A launcher's port answers before its daphne has loaded Django: the handshake waits.
    async with connect(url, additional_headers=bearer(f"t-{name}"), open_timeout=60) as ws:
        await ws.send(json.dumps(CAPS))
        assert (await next_frame(ws))["type"] == "InitAck"
        yield ws


async def next_frame(ws, timeout=10.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def close_code(ws, send: str | None = None, timeout=15.0) -> int:
    """The code of the close frame the server sends next (frames before it are skipped), after
    sending SEND if given: a frame the server closes on may end the connection mid-send."""
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        async with asyncio.timeout(timeout):
            if send is not None:
                await ws.send(send)
            while True:
                await ws.recv()
    return NO_CLOSE_FRAME if closed.value.rcvd is None else closed.value.rcvd.code


def padded(frame: dict, size: int) -> str:
    """FRAME with an unknown field (ignored by the server) making it SIZE bytes long."""
    text = json.dumps({**frame, "padding": ""})
    return json.dumps({**frame, "padding": "x" * (size - len(text))})


# Just over the limit, and far over it (the server reads and drops the rest of the frame).
@pytest.mark.parametrize("size", [MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES + 50 * 1024, 16 << 20])
async def test_a_frame_over_1_mib_closes_the_socket_with_1009(url, size):
    await worker("big")
    async with session(url, "big") as ws:
        frame = padded({"type": "RequestJob", "kind": "build"}, size)
        assert await close_code(ws, send=frame) == 1009


async def test_a_frame_of_exactly_1_mib_is_handled_and_the_session_goes_on(url):
    await worker("edge")
    async with session(url, "edge") as ws:
        frame = padded({"type": "NoSuchMessage"}, MAX_FRAME_BYTES)
        assert len(frame.encode()) == MAX_FRAME_BYTES
        await ws.send(frame)
        assert (await next_frame(ws))["code"] == "bad_message"
        await ws.send(json.dumps({"type": "NoSuchMessage"}))
        assert (await next_frame(ws))["code"] == "bad_message"


async def test_a_second_connection_with_the_same_token_closes_the_first_with_4409(url):
    await worker("twice")
    async with session(url, "twice") as first, session(url, "twice") as second:
        assert await close_code(first) == 4409
        await second.send(json.dumps({"type": "NoSuchMessage"}))
        assert (await next_frame(second))["code"] == "bad_message"


async def run(process_env, *args: str, **extra_env) -> str:
    """A management command in a process of its own, on the servers' database and Redis."""
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "python"),
        "manage.py",
        *args,
        env={**process_env, **extra_env},
        cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return out.decode()


async def test_revoking_the_token_closes_the_live_connection_with_4403(url, process_env):
    await worker("revokee")
    async with session(url, "revokee") as ws:
        out = await run(process_env, "create_worker", "revokee", "--revoke")
        assert json.loads(out) == {"worker": "revokee", "revoked": True}
        assert await close_code(ws) == 4403
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        async with connect(url, additional_headers=bearer("t-revokee"), open_timeout=60):
            pass
    assert refused.value.response.status_code == 403


async def test_the_liveness_pass_closes_a_silent_worker_with_4408(url, process_env):
    await worker("mute")
    async with session(url, "mute") as ws:
        await asyncio.sleep(1.5)
        # The pass Celery runs, in a process of its own, with a 1 s timeout.
        out = await run(
            process_env,
            "shell",
            "--no-imports",
            "-c",
            "from sessions.tasks import liveness; print(liveness())",
            GRADIENT_WORKER_TIMEOUT_SECS="1",
        )
        assert out.split() == ["1"]
        assert await close_code(ws) == 4408


class Cuttable:
    """A TCP relay to PostgreSQL that can be cut: the server behind it then finds the database
    gone, as in a PostgreSQL restart, while the test's own connection stays."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.is_cut = False
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # cut
            server = socket.create_connection(self.target)
            with self.lock:
                if self.is_cut:  # accepted while cut() ran: it must not get through
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    @staticmethod
    def pump(source: socket.socket, sink: socket.socket):
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self):
        # shutdown() wakes the accept() under way, which close() alone would leave blocked.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            self.is_cut = True
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
async def test_a_frame_whose_handling_fails_closes_the_session_with_4500(launcher, processes):
    db = connection.settings_dict
    relay = Cuttable(int(db["PORT"] or 5432))
    try:
        url = processes.daphne(
            launcher, DATABASE_URL=f"postgres://{db['USER']}@127.0.0.1:{relay.port}/{db['NAME']}"
        )
        await worker("unlucky")
        async with session(url, "unlucky") as ws:
            relay.cut()
            request = json.dumps({"type": "RequestJob", "kind": "build"})
            assert await close_code(ws, send=request) == 4500
    finally:
        relay.cut()
    assert "OperationalError" in processes.log_text("daphne-")
