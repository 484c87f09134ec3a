"""Signals between members on one machine (protocol.md, "Signals between members"): the
agent's SignalHub on real Unix sockets, and `gradient-worker signal` as real processes."""

import asyncio
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio

from gradient.wire.protocol import MAX_SIGNAL_PAYLOAD_BYTES
from workers.agent.signals import (
    MAX_KEPT_SIGNALS,
    MAX_LINE_BYTES,
    MAX_UNIX_PATH_BYTES,
    NOT_CONNECTED,
    SOCKET_NAME_BYTES,
    SignalHub,
)

ATTEMPT = "00000000-0000-4000-8000-000000000101"
OTHER_ATTEMPT = "00000000-0000-4000-8000-000000000102"
SERVER = {"role": "server", "index": 0}
CLIENT = {"role": "client", "index": 1}
ROOT = Path(__file__).resolve().parent.parent
BOUND = 10.0  # seconds any awaited condition may take


class Agent:
    """The hub's boundary: what it handed to the server's connection, and whether it could."""

    def __init__(self):
        self.sent: list[tuple[str, dict | None, object]] = []
        self.events: list[tuple[str, dict]] = []
        self.connected = True
        self.failure: Exception | None = None

    async def send(self, attempt: str, to: dict | None, payload) -> bool:
        if self.failure is not None:
            raise self.failure
        if self.connected:
            self.sent.append((attempt, to, payload))
        return self.connected

    def log(self, event: str, **fields) -> None:
        self.events.append((event, fields))


class Reader:
    """A process's connection to its attempt's socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: str) -> "Reader":
        return cls(*await asyncio.open_unix_connection(path, limit=2 * MAX_LINE_BYTES))

    def write(self, line: dict | bytes) -> None:
        self.writer.write(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n")

    async def line(self) -> dict:
        text = await asyncio.wait_for(self.reader.readline(), BOUND)
        assert text.endswith(b"\n"), text
        return json.loads(text)

    async def lines(self, count: int) -> list[dict]:
        return [await self.line() for _ in range(count)]

    async def rest(self) -> list[dict]:
        """Every line until the hub closes the connection."""
        data = await asyncio.wait_for(self.reader.read(), BOUND)
        return [json.loads(line) for line in data.splitlines()]

    def close(self) -> None:
        self.writer.close()


async def until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while not condition():
        assert loop.time() < deadline, f"still waiting for {what}"
        await asyncio.sleep(0.01)


def signal(sender: dict, payload) -> dict:
    return {"from": sender, "payload": payload}


@pytest.fixture
def directory():
    # Not pytest's tmp_path: a test's name in it could make a socket path too long.
    base = Path(tempfile.mkdtemp(prefix="sig-"))
    yield base / "signals"
    shutil.rmtree(base)


@pytest.fixture
def agent():
    return Agent()


@pytest_asyncio.fixture
async def hub(directory, agent):
    hub = SignalHub(directory, agent.send, log=agent.log)
    yield hub
    await hub.close_all()


# The hub


@pytest.mark.asyncio
async def test_a_reader_connecting_late_gets_every_signal_so_far_in_order_then_each_new_one(hub):
    hub.deliver(ATTEMPT, SERVER, "before the member started")
    path = await hub.open(ATTEMPT)
    hub.deliver(ATTEMPT, CLIENT, {"n": 2})
    hub.deliver(ATTEMPT, SERVER, [3])

    reader = await Reader.connect(path)
    assert await reader.lines(3) == [
        signal(SERVER, "before the member started"),
        signal(CLIENT, {"n": 2}),
        signal(SERVER, [3]),
    ]
    hub.deliver(ATTEMPT, CLIENT, None)
    assert await reader.line() == signal(CLIENT, None)


@pytest.mark.asyncio
async def test_new_signals_reach_every_connected_reader(hub):
    path = await hub.open(ATTEMPT)
    readers = [await Reader.connect(path) for _ in range(8)]
    for n in range(3):
        hub.deliver(ATTEMPT, SERVER, n)
    received = await asyncio.gather(*(reader.lines(3) for reader in readers))
    assert received == [[signal(SERVER, n) for n in range(3)]] * 8


@pytest.mark.asyncio
async def test_each_attempt_reads_its_own_signals(hub):
    first, second = await hub.open(ATTEMPT), await hub.open(OTHER_ATTEMPT)
    assert first != second
    hub.deliver(ATTEMPT, SERVER, "first")
    hub.deliver(OTHER_ATTEMPT, SERVER, "second")
    assert await (await Reader.connect(second)).line() == signal(SERVER, "second")
    assert await (await Reader.connect(first)).line() == signal(SERVER, "first")


@pytest.mark.asyncio
async def test_past_a_thousand_signals_the_oldest_are_dropped(hub):
    path = await hub.open(ATTEMPT)
    for n in range(MAX_KEPT_SIGNALS + 5):
        hub.deliver(ATTEMPT, SERVER, n)
    reader = await Reader.connect(path)
    received = await reader.lines(MAX_KEPT_SIGNALS)
    assert [line["payload"] for line in received] == list(range(5, MAX_KEPT_SIGNALS + 5))
    hub.deliver(ATTEMPT, CLIENT, "next")
    assert await reader.line() == signal(CLIENT, "next")


@pytest.mark.asyncio
async def test_a_line_is_sent_to_one_member_or_to_all(hub, agent):
    reader = await Reader.connect(await hub.open(ATTEMPT))
    reader.write({"to": SERVER, "payload": {"ready": True}})
    reader.write({"payload": [1, 2]})
    reader.write({"to": None, "payload": None, "unknown": "ignored"})
    await until(lambda: len(agent.sent) == 3, "three signals sent")
    assert agent.sent == [
        (ATTEMPT, SERVER, {"ready": True}),
        (ATTEMPT, None, [1, 2]),
        (ATTEMPT, None, None),
    ]


@pytest.mark.asyncio
async def test_half_closing_hands_over_what_was_written_then_the_hub_closes(hub, agent):
    hub.deliver(ATTEMPT, SERVER, "already here")
    reader = await Reader.connect(await hub.open(ATTEMPT))
    reader.write({"payload": 1})
    reader.write({"to": CLIENT, "payload": 2})
    reader.writer.write_eof()
    lines = await reader.rest()
    assert agent.sent == [(ATTEMPT, None, 1), (ATTEMPT, CLIENT, 2)]
    assert all("error" not in line for line in lines)


@pytest.mark.asyncio
async def test_a_bad_line_is_answered_and_the_connection_goes_on(hub, agent):
    reader = await Reader.connect(await hub.open(ATTEMPT))
    bad = [
        b"not json\n",
        b"[1, 2]\n",
        b'{"to": {"role": "server", "index": -1}, "payload": 1}\n',
        b'{"to": "server/0", "payload": 1}\n',
        b'{"to": null}\n',
        b'{"payload": NaN}\n',
        b'{"payload": "' + b"x" * MAX_LINE_BYTES + b'"}\n',
        b"\n",
    ]
    for line in bad:
        reader.write(line)
    reader.write({"payload": "still heard"})
    errors = await reader.lines(len(bad))
    assert [set(error) for error in errors] == [{"error"}] * len(bad)
    assert "not JSON" in errors[0]["error"]
    assert "JSON object" in errors[1]["error"]
    assert errors[2]["error"].startswith("to.index:")
    assert errors[3]["error"].startswith("to:")
    assert errors[4]["error"].startswith("payload:")
    assert "NaN" in errors[5]["error"]
    assert str(MAX_LINE_BYTES) in errors[6]["error"]
    await until(lambda: agent.sent == [(ATTEMPT, None, "still heard")], "the good line sent")
    reader.writer.write_eof()
    assert await reader.rest() == []  # one answer per bad line, no more


@pytest.mark.asyncio
async def test_a_payload_over_64_kib_encoded_is_refused(hub, agent):
    reader = await Reader.connect(await hub.open(ATTEMPT))
    largest = "x" * (MAX_SIGNAL_PAYLOAD_BYTES - 2)  # with its quotes, 64 KiB exactly
    reader.write({"payload": largest + "x"})
    assert "payload over" in (await reader.line())["error"]
    reader.write({"payload": largest})
    reader.writer.write_eof()
    assert await reader.rest() == []
    assert agent.sent == [(ATTEMPT, None, largest)]


@pytest.mark.asyncio
async def test_a_signal_is_refused_while_the_agent_has_no_connection(hub, agent):
    agent.connected = False
    reader = await Reader.connect(await hub.open(ATTEMPT))
    reader.write({"payload": "lost?"})
    assert await reader.line() == {"error": NOT_CONNECTED}
    agent.connected = True
    reader.write({"payload": "again"})
    await until(lambda: agent.sent == [(ATTEMPT, None, "again")], "the retry sent")


@pytest.mark.asyncio
async def test_a_send_that_raises_is_answered_not_taken_for_handed_over(hub, agent):
    agent.failure = RuntimeError("frame too large")
    reader = await Reader.connect(await hub.open(ATTEMPT))
    reader.write({"payload": 1})
    reader.writer.write_eof()
    assert await reader.rest() == [{"error": "the signal could not be sent: frame too large"}]
    assert agent.events[0][0] == "signal_send_failed"


@pytest.mark.asyncio
async def test_a_slow_reader_blocks_no_one_and_is_dropped_once_behind_the_kept_signals(hub, agent):
    path = await hub.open(ATTEMPT)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(path)  # and never reads
    fast = await Reader.connect(path)
    received: list[dict] = []

    async def read_fast():
        while True:
            received.append(await fast.line())

    reading = asyncio.create_task(read_fast())
    payload = "p" * 1024
    total = 3 * MAX_KEPT_SIGNALS
    try:
        for batch in range(0, total, 100):
            for n in range(batch, batch + 100):
                hub.deliver(ATTEMPT, SERVER, [n, payload])
            await until(lambda b=batch: len(received) == b + 100, "the fast reader's signals")
    finally:
        reading.cancel()
    assert [line["payload"][0] for line in received] == list(range(total))
    assert ("signal_reader_dropped", {"attempt": ATTEMPT, "reason": "not reading"}) in agent.events

    # The slow reader got what its buffers held, in order, then the end of its connection.
    slow.setblocking(False)
    data = b""
    loop = asyncio.get_running_loop()
    try:
        while chunk := await asyncio.wait_for(loop.sock_recv(slow, 65536), BOUND):
            data += chunk
    except ConnectionResetError:
        pass
    slow.close()
    got = [json.loads(line)["payload"][0] for line in data.splitlines()[:-1]]
    assert 0 < len(got) < total - MAX_KEPT_SIGNALS
    assert got == list(range(len(got)))


@pytest.mark.asyncio
async def test_close_ends_the_readers_removes_the_socket_and_forgets_the_inbox(hub):
    path = await hub.open(ATTEMPT)
    hub.deliver(ATTEMPT, SERVER, "old")
    reader = await Reader.connect(path)
    assert await reader.line() == signal(SERVER, "old")

    await hub.close(ATTEMPT)
    assert await asyncio.wait_for(reader.reader.read(), BOUND) == b""
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError):
        await Reader.connect(path)

    hub.deliver(ATTEMPT, SERVER, "late: the job has ended")
    assert await hub.open(ATTEMPT) == path
    hub.deliver(ATTEMPT, CLIENT, "new")
    assert await (await Reader.connect(path)).line() == signal(CLIENT, "new")


@pytest.mark.asyncio
async def test_open_is_idempotent(hub):
    path = await hub.open(ATTEMPT)
    reader = await Reader.connect(path)
    assert await hub.open(ATTEMPT) == path
    hub.deliver(ATTEMPT, SERVER, "still connected")
    assert await reader.line() == signal(SERVER, "still connected")


@pytest.mark.asyncio
async def test_the_socket_is_the_agent_users_alone(hub, directory):
    path = await hub.open(ATTEMPT)
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


@pytest.mark.asyncio
async def test_a_directory_at_the_unix_path_limit_works_and_one_longer_is_refused(directory, agent):
    longest = MAX_UNIX_PATH_BYTES - 1 - SOCKET_NAME_BYTES
    padded = directory / ("d" * (longest - len(os.fsencode(directory)) - 1))
    assert len(os.fsencode(padded)) == longest
    hub = SignalHub(padded, agent.send)
    try:
        reader = await Reader.connect(await hub.open(ATTEMPT))
        reader.write({"payload": "fits"})
        await until(lambda: agent.sent == [(ATTEMPT, None, "fits")], "the signal sent")
    finally:
        await hub.close_all()
    with pytest.raises(ValueError, match="too long for a Unix socket path"):
        SignalHub(Path(str(padded) + "d"), agent.send)


# gradient-worker signal, as real processes


async def run_cli(*args: str, socket_path: str | None = None) -> tuple[int, str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "GRADIENT_SIGNAL_SOCKET"}
    if socket_path is not None:
        env["GRADIENT_SIGNAL_SOCKET"] = socket_path
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.agent.signal_cli",
        *args,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 3 * BOUND)
    return process.returncode, out.decode(), err.decode().splitlines()


@pytest.mark.asyncio
async def test_signal_send_hands_the_payload_over_and_exits_0(hub, agent):
    path = await hub.open(ATTEMPT)
    hub.deliver(ATTEMPT, CLIENT, "replayed to the sender, and ignored")
    assert await run_cli("send", "--to", "server/0", '{"ready": true}', socket_path=path) == (
        0,
        "",
        [],
    )
    assert await run_cli("send", '"to all"', socket_path=path) == (0, "", [])
    assert agent.sent == [(ATTEMPT, SERVER, {"ready": True}), (ATTEMPT, None, "to all")]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["send", "{nope"], "PAYLOAD_JSON is not JSON"),
        (["send", "NaN"], "PAYLOAD_JSON is not JSON"),
        (["send", json.dumps("x" * MAX_SIGNAL_PAYLOAD_BYTES)], "payload over"),
        (["send", "--to", "server", "1"], "argument --to"),
        (["send", "--to", "server/-1", "1"], "argument --to"),
        (["send"], "PAYLOAD_JSON"),
        (["wait", "--timeout", "0"], "argument --timeout"),
        (["wait", "--timeout", "soon"], "argument --timeout"),
        (["wait", "--from", "/0"], "argument --from"),
        (["shout", "1"], "invalid choice"),
        ([], "required"),
    ],
)
async def test_signal_commands_refuse_bad_arguments_with_one_line_and_exit_2(
    hub, agent, args, says
):
    path = await hub.open(ATTEMPT)
    status, out, err = await run_cli(*args, socket_path=path)
    assert (status, out, len(err)) == (2, "", 1), err
    assert err[0].startswith("gradient-worker signal: ")
    assert says in err[0]
    assert agent.sent == []


@pytest.mark.asyncio
@pytest.mark.parametrize("args", [["send", "1"], ["wait", "--timeout", "5"]])
async def test_signal_commands_outside_a_member_exit_2(args):
    status, out, err = await run_cli(*args)
    assert (status, out) == (2, "")
    assert err == [
        "gradient-worker signal: GRADIENT_SIGNAL_SOCKET is not set:"
        " signals are for the members of a cluster"
    ]


@pytest.mark.asyncio
async def test_signal_send_exits_1_while_the_agent_has_no_connection(hub, agent):
    agent.connected = False
    status, out, err = await run_cli("send", "1", socket_path=await hub.open(ATTEMPT))
    assert (status, out, err) == (1, "", [f"gradient-worker signal: {NOT_CONNECTED}"])


@pytest.mark.asyncio
async def test_signal_send_exits_1_when_the_socket_is_gone(hub):
    path = await hub.open(ATTEMPT)
    await hub.close(ATTEMPT)
    status, _, err = await run_cli("send", "1", socket_path=path)
    assert status == 1
    assert err[0].startswith(f"gradient-worker signal: cannot reach the agent at {path}")


@pytest.mark.asyncio
async def test_signal_wait_prints_the_first_matching_payload(hub):
    path = await hub.open(ATTEMPT)
    hub.deliver(ATTEMPT, CLIENT, {"first": 1})
    hub.deliver(ATTEMPT, SERVER, {"port": 5000})
    hub.deliver(ATTEMPT, SERVER, {"port": 5001})
    assert await run_cli("wait", socket_path=path) == (0, '{"first": 1}\n', [])
    assert await run_cli("wait", "--from", "server/0", socket_path=path) == (
        0,
        '{"port": 5000}\n',
        [],
    )


@pytest.mark.asyncio
async def test_signal_wait_gets_a_signal_that_comes_while_it_waits(hub):
    path = await hub.open(ATTEMPT)
    waiting = asyncio.create_task(run_cli("wait", "--from", "client/1", socket_path=path))
    hub.deliver(ATTEMPT, SERVER, "not this one")
    hub.deliver(ATTEMPT, CLIENT, "go")
    assert await waiting == (0, '"go"\n', [])


@pytest.mark.asyncio
async def test_signal_wait_exits_1_when_the_timeout_passes_first(hub):
    path = await hub.open(ATTEMPT)
    hub.deliver(ATTEMPT, SERVER, "from someone else")
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, out, err = await run_cli(
        "wait", "--from", "client/1", "--timeout", "0.5", socket_path=path
    )
    assert loop.time() - started >= 0.5
    assert (status, out) == (1, "")
    assert err == ["gradient-worker signal: no matching signal within 0.5 seconds"]
