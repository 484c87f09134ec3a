"""A worker's session with the server: connect, reconnect with backoff over several servers, the
handshake's refusals, InitAck and the heartbeat's RequestJobs, offers, signals, errors, and the
outbox of reports that waits for the next session when one is lost. What it holds and runs is
workers.client.worker's."""

import asyncio
import contextlib
import random
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from gradient.wire import protocol as p
from workers.client.config import ClientConfig
from workers.client.events import EventSink, now
from workers.client.outbox import Outbox
from workers.client.servers import DEFAULT_URL, REPLACED_CLOSE_CODE, Verifier, server_urls


class Connection:
    """The session loop: connects and serves until stop(), a 4409 close (replaced), repeated
    403s at the handshake (forbidden) or a server certificate that does not verify.

    `url` may be a list of servers: the worker connects to the first, and every reconnect (a
    failed handshake or a dropped session) tries the next one, round robin. `name` is None
    until the server names the worker in InitAck."""

    def __init__(
        self,
        name: str | None,
        token: str,
        config: ClientConfig,
        url: str | Sequence[str] = DEFAULT_URL,
        log: EventSink | None = None,
    ):
        self.name = name
        self.token = token
        self.config = config
        self.urls = server_urls(url)
        self._url_index = 0
        self.log = log
        kept = config.max_events
        self.events: deque[dict] = deque(maxlen=kept)
        self.errors: deque[dict] = deque(maxlen=kept)  # Error frames: {code, message}
        self.signals: deque[dict] = deque(maxlen=kept)  # received: {attempt, from, payload}
        self.connections = 0  # sessions that got an InitAck
        self.connected = False  # InitAck received on the live connection
        self.forbidden = 0  # 403s at the handshake since the last session
        self.stopped_reason: str | None = None  # forbidden, replaced, certificate, stopped
        seed = config.seed
        self._rng = random.Random(f"{seed}:{name}") if seed is not None else random.Random()
        self._ws: ClientConnection | None = None
        self._changed = asyncio.Event()  # a report or a job left: settled() looks again
        self._outbox = Outbox(self._changed)
        self._heartbeat: asyncio.Task | None = None
        self._answering = asyncio.Lock()  # held while an offer is scored
        self._background: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tls = Verifier(config.ca_file)

    # Public API

    @property
    def url(self) -> str:
        """The server the worker is connected to, or will try next."""
        return self.urls[self._url_index]

    @property
    def unsent(self) -> int:
        """Final reports still waiting for a session."""
        return len(self._outbox)

    def capabilities(self) -> p.WorkerCapabilities:
        """What the worker can do, and what it still runs or holds a report of: after a
        server restart or a lost connection, the server keeps those assignments open."""
        running = [*self._running_ids(), *self._outbox.ids()]
        return self.config.capabilities().model_copy(update={"running": running})

    def _running_ids(self) -> list[p.RunningJob]:
        return []

    def free_slots(self, kind: str) -> int:
        return self.config.slots(kind)

    async def run(self) -> None:
        """Connects and serves until it stops for good (see the class)."""
        self._task = asyncio.current_task()
        first, cap = self.config.backoff
        delay = first
        try:
            while not self._stop.is_set():
                if await self._connect_once():
                    delay = first
                if self._stop.is_set():
                    break
                self._url_index = (self._url_index + 1) % len(self.urls)  # try the next server
                # Jittered, so a fleet does not come back from a server restart in lockstep.
                if self.forbidden:
                    wait = self.config.forbidden_backoff * 2 ** (self.forbidden - 1)
                    await self._sleep(wait * self._rng.uniform(0.75, 1.25))
                    continue
                await self._sleep(min(cap, delay * self._rng.uniform(0.5, 1.5)))
                delay = min(delay * 2, cap)
        except asyncio.CancelledError:
            if not self._stop.is_set():
                raise
        except Exception as exc:
            self.stopped_reason = f"crashed: {exc!r}"  # shows in the fleet's summary
            raise
        finally:
            self._shut()
            self.stopped_reason = self.stopped_reason or "stopped"
            self._record("stopped", reason=self.stopped_reason)

    async def stop(self) -> None:
        self._stop.set()
        ws = self._ws
        if ws is not None:
            await ws.close()
        elif self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()  # connecting or backing off: nothing to close cleanly

    async def send_signal(
        self, attempt: str, payload: Any, to: tuple[str, int] | None = None
    ) -> bool:
        """Sends a ClusterSignal to one member (role, index) or, without `to`, to all others.
        False if there was no connection to send it on."""
        target = None if to is None else p.MemberRef(role=to[0], index=to[1])
        sent = await self._send(p.ClusterSignal(attempt=attempt, to=target, payload=payload))
        if sent:
            where = None if target is None else target.model_dump()
            self._record("signal_sent", attempt=attempt, to=where, payload=payload)
        return sent

    async def wait_event(self, event: str, timeout: float = 5.0, **fields) -> dict:
        """The first recorded event of that name whose fields match (for tests)."""
        wanted = {"event": event, **fields}
        async with asyncio.timeout(timeout):
            while True:
                for entry in self.events:
                    if all(entry.get(k) == v for k, v in wanted.items()):
                        return entry
                await asyncio.sleep(0.01)

    # Hooks for what the worker holds (workers.client.worker)

    def _session_lost(self) -> None:
        """The connection closed: what cannot outlive a session goes."""

    def _shut(self) -> None:
        """The worker stops for good."""

    # Connection

    async def _connect_once(self) -> bool:
        """One connection, until it closes. True if it got as far as an InitAck."""
        url = self.url
        try:
            # The TLS handshake completes before the HTTP upgrade that carries the token, so a
            # server whose certificate does not verify never sees it.
            async with connect(
                url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                open_timeout=self.config.open_timeout,
                max_size=p.MAX_FRAME_BYTES,
                compression=None,  # a zlib context per connection is too heavy for a fleet
                proxy=None,
                ssl=self._tls.context_for(url),
            ) as ws:
                self._ws = ws
                self._record("connected", url=url)
                sessions = self.connections
                try:
                    await self._serve(ws)
                finally:
                    self._ws = None
                    self._disconnected(ws, url)
                return self.connections > sessions
        except InvalidStatus as exc:
            status = exc.response.status_code
            self._record("connect_failed", url=url, error=f"HTTP {status}")
            if status == 403:
                self.forbidden += 1
                if self.forbidden > self.config.forbidden_retries:
                    self._finish("forbidden")
        except ssl.SSLCertVerificationError as exc:
            self._record("connect_failed", url=url, error=f"certificate: {exc.verify_message}")
            self._finish("certificate")
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
            self._record("connect_failed", url=url, error=str(exc) or type(exc).__name__)
        return False

    async def _serve(self, ws: ClientConnection) -> None:
        try:
            await ws.send(self.capabilities().frame())
            async for text in ws:
                await self._handle(text)
        except ConnectionClosed:
            pass

    def _disconnected(self, ws: ClientConnection, url: str) -> None:
        self.connected = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        code = ws.close_code
        self._record("disconnected", url=url, code=code, reason=ws.close_reason or None)
        self._session_lost()
        if code == REPLACED_CLOSE_CODE:
            self._finish("replaced")

    def _finish(self, reason: str) -> None:
        self.stopped_reason = reason
        self._stop.set()

    def _drop_connection(self) -> None:
        """Close the live connection from within a frame's handler; the loop reconnects."""
        if self._ws is not None:
            self._spawn(self._ws.close())

    async def _sleep(self, secs: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), secs)

    async def _send(self, message: p.Message) -> bool:
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(message.frame())
        except ConnectionClosed:
            return False  # the reader sees the close and ends the session
        return True

    async def _report(self, message: p.Message) -> None:
        """A job's final report: queued behind the others, sent now if a session is up, else
        by the next one, after its InitAck."""
        self._outbox.add(message)
        await self._flush()

    async def _flush(self) -> None:
        await self._outbox.flush(self._send_in_session)

    async def _send_in_session(self, message: p.Message) -> bool:
        """Reports go only to a session that sent its InitAck."""
        return self.connected and await self._send(message)

    async def settled(self) -> None:
        """Returns once the worker holds no job and every report went out."""
        while self._holds_work() or self._outbox:
            self._changed.clear()
            await self._changed.wait()

    def _holds_work(self) -> bool:
        return False

    # Server frames

    async def _handle(self, text: str | bytes) -> None:
        try:
            message = p.parse_outbound(text)
        except p.ProtocolError as exc:
            self._record("error", code="unparsable", message=str(exc))
            return
        try:
            await getattr(self, self._HANDLERS[type(message)])(message)
        except ValueError as exc:  # a field the answer must echo fails the protocol's checks
            self._record("error", code="cannot_answer", message=str(exc))

    _HANDLERS = {
        p.InitAck: "_on_init_ack",
        p.JobOffer: "_on_offer",
        p.ForwardedSignal: "_on_signal",
        p.Error: "_on_error",
    }

    async def _on_init_ack(self, ack: p.InitAck) -> None:
        self._record("init_ack", protocol=ack.protocol, heartbeat_secs=ack.heartbeat_secs)
        self.connected = True
        self.connections += 1
        self.forbidden = 0
        await self._flush()  # reports from before the drop go first
        await self._session_began()
        await self._request_free_slots()
        if self._heartbeat is None:
            period = self.config.heartbeat_secs or ack.heartbeat_secs
            self._heartbeat = self._spawn(self._heartbeat_loop(period))

    async def _session_began(self) -> None:
        """InitAck came and the kept reports went: before the first RequestJob."""

    async def _heartbeat_loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await self._request_free_slots()

    async def _request_free_slots(self) -> None:
        for kind in ("eval", "build"):
            for _ in range(self.free_slots(kind)):
                await self._request(kind)

    async def _request(self, kind: str) -> None:
        async with self._answering:  # an offer's scores go first
            if self.connected:
                await self._send(p.RequestJob(kind=kind))

    async def _on_offer(self, offer: p.JobOffer) -> None:
        # Answered before the reader takes the next frame, and before any RequestJob that a
        # heartbeat or a finished job would send meanwhile.
        async with self._answering:
            await self._send(p.JobScores(scores=await self._scores(offer.jobs)))

    async def _scores(self, jobs: list[p.OfferedJob]) -> list[p.Score]:
        """What this worker would fetch for each offered job."""
        raise NotImplementedError

    async def _on_signal(self, signal: p.ForwardedSignal) -> None:
        entry = {
            "attempt": signal.attempt,
            "from": signal.from_.model_dump(),
            "payload": signal.payload,
        }
        self.signals.append(entry)
        self._record("signal_received", **entry)

    async def _on_error(self, error: p.Error) -> None:
        self.errors.append({"code": error.code, "message": error.message})
        self._record("error", code=error.code, message=error.message)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _record(self, event: str, **fields) -> None:
        entry = {"time": now(), "worker": self.name, "event": event, **fields}
        self.events.append(entry)
        if self.log is not None:
            self.log.write(entry)
