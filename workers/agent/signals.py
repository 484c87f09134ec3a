"""Signals between the members of an attempt, on one machine (protocol.md, "Running real work",
"Signals between members"): one Unix socket per started attempt, GRADIENT_SIGNAL_SOCKET.

A process connects and writes one JSON object a line, {"to": {"role", "index"} | null,
"payload": ANY}, handed to the server as a ClusterSignal; it reads one JSON object a line,
{"from": {"role", "index"}, "payload": ANY}: every signal the attempt has received so far, in
order, then each new one. A bad line is answered {"error": "..."} and the connection goes on.
Imports nothing of Django.
"""

import asyncio
import contextlib
import hashlib
import json
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gradient.wire import protocol as p

# (attempt, to {"role", "index"} or None, payload) -> handed to the server's connection?
Send = Callable[[str, dict | None, Any], Awaitable[bool]]

MAX_KEPT_SIGNALS = 1000  # per attempt (protocol.md); the oldest go first
# A line holds a payload of at most MAX_SIGNAL_PAYLOAD_BYTES as json.dumps writes it; a member
# may write the same value longer (spaces, escapes), so a line may be a few times that.
MAX_LINE_BYTES = 4 * p.MAX_SIGNAL_PAYLOAD_BYTES
MAX_UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL
ENDED_KEPT = 256  # attempts remembered as ended, so that a late signal is not kept for ever
NOT_CONNECTED = "the agent is not connected to the server: the signal was not sent"
# Any UUID stands in for the attempt when checking a line: the hub sends for its own attempt.
_STAND_IN_ATTEMPT = "00000000-0000-0000-0000-000000000000"


class BadLine(ValueError):
    """A line a member wrote that is not a signal to send; its message is the answer."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes) -> Any:
    """Strict JSON: NaN and Infinity, which json accepts by default, are not JSON."""
    return json.loads(text, parse_constant=_no_constant)


def checked_signal(data: Any) -> tuple[dict | None, Any]:
    """A request object -> (to, payload), by the wire's ClusterSignal rules (a payload of at
    most MAX_SIGNAL_PAYLOAD_BYTES encoded); BadLine says what is wrong in one line."""
    if not isinstance(data, dict):
        raise BadLine("a line must be a JSON object")
    try:
        signal = p.ClusterSignal.model_validate({**data, "attempt": _STAND_IN_ATTEMPT})
    except ValidationError as exc:
        raise BadLine(_describe(exc)) from None
    return (signal.to.model_dump() if signal.to else None), signal.payload


def _parse_line(line: bytes) -> tuple[dict | None, Any]:
    try:
        data = loads(line)
    except (ValueError, RecursionError) as exc:
        raise BadLine(f"the line is not JSON: {exc}") from None
    return checked_signal(data)


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}"


def _encode(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"


def socket_name(attempt: str) -> str:
    """Short and fixed-length, whatever the attempt's name: AF_UNIX paths are short."""
    return hashlib.blake2b(attempt.encode(), digest_size=8).hexdigest() + ".sock"


SOCKET_NAME_BYTES = len(socket_name(""))


async def _lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes | None]:
    """Each line the peer writes (the last may lack its newline), None for one over
    MAX_LINE_BYTES: that line is skipped to its end without being held."""
    skipping = False
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError as exc:
            await reader.readexactly(exc.consumed)
            skipping = True
            continue
        except asyncio.IncompleteReadError as exc:
            if skipping or exc.partial:
                yield None if skipping else exc.partial
            return
        yield None if skipping else line
        skipping = False


class _Inbox:
    """The attempt's received signals as encoded lines, numbered from the first ever received."""

    def __init__(self):
        self.lines: deque[bytes] = deque(maxlen=MAX_KEPT_SIGNALS)
        self.first = 0  # the number of lines[0]
        self._added = asyncio.Event()

    @property
    def end(self) -> int:
        return self.first + len(self.lines)

    def add(self, line: bytes) -> None:
        if len(self.lines) == MAX_KEPT_SIGNALS:
            self.first += 1
        self.lines.append(line)
        self._added.set()
        self._added = asyncio.Event()

    def line(self, number: int) -> bytes:
        return self.lines[number - self.first]

    async def wait_beyond(self, number: int) -> None:
        while self.end <= number:
            await self._added.wait()


class _Connection:
    """One connected process: the inbox is streamed to it by its own task, so a reader that
    does not read holds at most the transport's buffer and blocks no one."""

    def __init__(self, inbox: _Inbox, writer: asyncio.StreamWriter):
        self.writer = writer
        self.next = inbox.first  # the number of the next line to write
        self.streaming = asyncio.create_task(self._stream(inbox))

    async def _stream(self, inbox: _Inbox) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await inbox.wait_beyond(self.next)
                self.writer.write(inbox.line(self.next))
                self.next += 1
                await self.writer.drain()

    def abort(self) -> None:
        self.streaming.cancel()
        self.writer.transport.abort()


class _Room:
    """One attempt on this agent: its inbox, and its socket once the member started."""

    def __init__(self, attempt: str, path: Path):
        self.attempt = attempt
        self.path = path
        self.inbox = _Inbox()
        self.server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        self.opening = asyncio.Lock()
        self.closed = False


class SignalHub:
    """Per started attempt on this agent: a Unix socket, the attempt's inbox (every
    ForwardedSignal received, the oldest dropped past MAX_KEPT_SIGNALS), and the connected
    readers. A reader whose next signal has been dropped did not keep up: it is disconnected.

    `directory` holds the sockets and is the hub's own (made private to the agent's user);
    `log(event, **fields)` hears of dropped readers and failing sends. Use on one event loop."""

    def __init__(self, directory: Path, send: Send, log: Callable[..., None] | None = None):
        self.directory = Path(directory).absolute()
        if len(os.fsencode(self.directory)) + 1 + SOCKET_NAME_BYTES > MAX_UNIX_PATH_BYTES:
            longest = MAX_UNIX_PATH_BYTES - 1 - SOCKET_NAME_BYTES
            raise ValueError(
                f"signal socket directory {self.directory} is too long for a Unix socket path:"
                f" at most {longest} bytes"
            )
        self._send = send
        self._log = log or (lambda event, **fields: None)
        self._rooms: dict[str, _Room] = {}
        self._ended: dict[str, None] = {}  # oldest first

    async def open(self, attempt: str) -> str:
        """Starts the attempt's socket (once) and returns its path for GRADIENT_SIGNAL_SOCKET."""
        self._ended.pop(attempt, None)
        room = self._room(attempt)
        async with room.opening:
            if room.server is None and not room.closed:
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                self.directory.chmod(0o700)  # no one else may reach a socket, even briefly
                room.path.unlink(missing_ok=True)  # left by an agent that ended abruptly
                room.server = await asyncio.start_unix_server(
                    lambda r, w: self._serve(room, r, w), path=room.path, limit=MAX_LINE_BYTES
                )
                room.path.chmod(0o600)
        return str(room.path)

    def deliver(self, attempt: str, sender: dict, payload: Any) -> None:
        """A ForwardedSignal from the server, kept even before the attempt's socket opens."""
        if attempt in self._ended:
            return
        room = self._room(attempt)
        room.inbox.add(_encode({"from": sender, "payload": payload}))
        for connection in list(room.connections):
            if connection.next < room.inbox.first:
                self._log("signal_reader_dropped", attempt=attempt, reason="not reading")
                connection.abort()

    async def close(self, attempt: str) -> None:
        """The attempt's job ended here: its readers are disconnected, its socket removed and
        its inbox forgotten; signals still arriving for it are not kept."""
        self._ended[attempt] = None
        if len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        room = self._rooms.pop(attempt, None)
        if room is None:
            return
        async with room.opening:
            room.closed = True
            if room.server is not None:
                room.server.close()
            for connection in list(room.connections):
                connection.abort()
            if room.server is not None:
                await room.server.wait_closed()
                room.path.unlink(missing_ok=True)

    async def close_all(self) -> None:
        for attempt in list(self._rooms):
            await self.close(attempt)

    def _room(self, attempt: str) -> _Room:
        if attempt not in self._rooms:
            self._rooms[attempt] = _Room(attempt, self.directory / socket_name(attempt))
        return self._rooms[attempt]

    async def _serve(
        self, room: _Room, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if room.closed:
            writer.transport.abort()
            return
        connection = _Connection(room.inbox, writer)
        room.connections.add(connection)
        try:
            async for line in _lines(reader):
                answer = await self._answer(room, line)
                if answer is not None:
                    writer.write(_encode({"error": answer}))
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            # The peer half-closed (or went): what it wrote has been handled, so closing
            # tells a sender that its signals were handed over.
            room.connections.discard(connection)
            connection.streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connection.streaming
            writer.close()

    async def _answer(self, room: _Room, line: bytes | None) -> str | None:
        """None once the line's signal was handed over, else the error to answer."""
        if line is None:
            return f"a line is limited to {MAX_LINE_BYTES} bytes"
        try:
            to, payload = _parse_line(line)
        except BadLine as exc:
            return str(exc)
        if room.closed:
            return "the attempt's job has ended"
        attempt = room.attempt
        try:
            sent = await self._send(attempt, to, payload)
        except Exception as exc:  # the sender must not read a clean close as "handed over"
            self._log("signal_send_failed", attempt=attempt, error=repr(exc))
            return f"the signal could not be sent: {exc}"
        # Answered, not queued: a queued signal could reach the server after its attempt
        # ended, or die with the agent, while its sender was told it was handed over. The
        # member decides whether to try again (gradient-worker signal send exits 1).
        return None if sent else NOT_CONNECTED
