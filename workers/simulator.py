"""The reference worker: simulated workers speaking protocol v1 (shared protocol.md) over real
WebSocket connections, many of them on one asyncio loop.

Imports nothing of Django: tests and the e2e harness run it in-process, next to a live server
or a fake one. Every frame is built and parsed with gradient.wire.protocol.
"""

import asyncio
import contextlib
import hashlib
import json
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from gradient.wire import protocol as p

DEFAULT_URL = "ws://127.0.0.1:8000/proto"
REPLACED_CLOSE_CODE = 4409
HOLD_TIMED_OUT = "cluster start timed out"
COUNTERS = ("workers", "connected", "idle", "held", "running", "completed", "failed", "rejected")
COUNTERS += ("stopped",)
SIZE_UNIT = 1 << 20  # per-path NAR sizes are whole MiB, 1 to 1024 of them

Scorer = Callable[[str, p.OfferedJob], tuple[int, int]]


@dataclass(frozen=True)
class WorkerConfig:
    """What one simulated worker can do and how it behaves. Capabilities go to the server as
    they are; the rest shapes the simulation."""

    architectures: tuple[str, ...] = ("x86_64-linux",)
    system_features: tuple[str, ...] = ()
    max_builds: int = 1
    max_evals: int = 1
    eval: bool = True
    build: bool = True
    fetch: bool = False
    zone: str | None = None
    endpoint: str | None = None
    job_secs: tuple[float, float] = (0.5, 2.0)  # a job runs for uniform(lo, hi) seconds
    fail_rate: float = 0.0  # chance a job ends in JobFailed{transient}
    reject_rate: float = 0.0  # chance a cluster member is refused
    have_fraction: float = 0.5  # share of offered paths the worker already has
    score: Scorer | None = None  # (worker name, offered job) -> (missing_count, missing_nar_size)
    score_secs: float = 0.0  # how long it takes to look at its store before it answers
    signal_on_start: bool = False  # on StartCluster, send one signal to every peer
    answers_members: bool = True  # False: a hung worker, holding members without a word
    heartbeat_secs: float | None = None  # overrides InitAck's, so tests need not wait 10 s
    backoff: tuple[float, float] = (0.1, 2.0)  # reconnect delay: first, cap
    # A 403 at the handshake is a refused token (protocol.md), but daphne also answers 403 to a
    # handshake its application did not accept in time (an overloaded server). So a 403 is
    # tried again this many times, after this long (doubling, jittered: 5 s to 80 s, about
    # 2.5 min in all), before the worker stops for good; a revoked worker costs the server a
    # few handshakes, and a worker refused by a server busy with a restart is soon back.
    forbidden_retries: int = 5
    forbidden_backoff: float = 5.0
    open_timeout: float = 10.0
    max_events: int | None = 1000  # events kept in memory (the log file keeps them all)
    seed: int | None = None  # with a seed, durations, failures and rejects are reproducible

    def slots(self, kind: str) -> int:
        if kind == "eval":
            return self.max_evals if (self.eval or self.fetch) else 0
        return self.max_builds if self.build else 0


def stable_hash(*parts: str) -> int:
    """A 64-bit hash that is the same in every process (unlike hash())."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def path_nar_size(path: str) -> int:
    """A path's NAR size: the same for every worker, so only which paths a worker has differs."""
    return (1 + stable_hash("size", path) % 1024) * SIZE_UNIT


def has_path(worker: str, path: str, fraction: float) -> bool:
    return stable_hash(worker, path) / 2**64 < fraction


def missing_cost(worker: str, paths: Iterable[str], fraction: float) -> tuple[int, int]:
    missing = [path for path in paths if not has_path(worker, path, fraction)]
    return len(missing), sum(map(path_nar_size, missing))


def rotated(urls: list[str], start: int) -> list[str]:
    start %= len(urls)
    return urls[start:] + urls[:start]


def _now() -> str:
    return datetime.now(UTC).isoformat()


class EventLog:
    """One JSON object per line, shared by every worker of a fleet. Line-buffered and appended,
    so a killed run leaves whole lines and several processes can share one file."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, event: dict) -> None:
        self._file.write(json.dumps(event, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass(eq=False, slots=True)
class Job:
    """An accepted assignment: held (a cluster member before StartCluster) or running."""

    job_id: str
    assignment_id: str
    kind: str
    attempt: str | None = None
    role: str | None = None
    index: int | None = None
    running: bool = False
    roster: list[dict] | None = None
    started_at: float = 0.0
    timer: asyncio.TimerHandle | None = None  # hold expiry
    task: asyncio.Task | None = None  # the run

    def ids(self) -> dict:
        return {"job_id": self.job_id, "assignment_id": self.assignment_id, "attempt": self.attempt}


def server_urls(url: str | Sequence[str]) -> list[str]:
    """One URL, or several: the servers to try in turn."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("at least one server URL is needed")
    return urls


class SimulatedWorker:
    """One worker: a connection loop that reconnects with backoff, and the jobs it holds or runs.
    Running jobs survive a reconnect (their reports wait in an outbox); held members do not.

    `url` may be a list of servers: the worker connects to the first, and every reconnect (a
    failed handshake or a dropped session) tries the next one, round robin."""

    def __init__(
        self,
        name: str,
        token: str,
        config: WorkerConfig | None = None,
        url: str | Sequence[str] = DEFAULT_URL,
        log: EventLog | None = None,
    ):
        self.name = name
        self.token = token
        self.config = config or WorkerConfig()
        self.urls = server_urls(url)
        self._url_index = 0
        self.log = log
        kept = self.config.max_events
        self.events: deque[dict] = deque(maxlen=kept)
        self.errors: deque[dict] = deque(maxlen=kept)  # Error frames: {code, message}
        self.signals: deque[dict] = deque(maxlen=kept)  # received: {attempt, from, payload}
        self.jobs: dict[str, Job] = {}
        self.completed = self.failed = self.rejected = 0
        self.connections = 0  # sessions that got an InitAck
        self.connected = False  # InitAck received on the live connection
        self.forbidden = 0  # 403s at the handshake since the last session
        self.draining = False
        self.stopped_reason: str | None = None  # forbidden, replaced, stopped
        seed = self.config.seed
        self._rng = random.Random(f"{seed}:{name}") if seed is not None else random.Random()
        self._ws: ClientConnection | None = None
        self._outbox: list[p.Message] = []  # reports made while disconnected
        self._heartbeat: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    # Public API

    @property
    def url(self) -> str:
        """The server the worker is connected to, or will try next."""
        return self.urls[self._url_index]

    @property
    def held(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.attempt is not None and not job.running]

    @property
    def running(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.running]

    def free_slots(self, kind: str) -> int:
        used = sum(1 for job in self.jobs.values() if job.kind == kind)
        return max(self.config.slots(kind) - used, 0)

    def capabilities(self) -> p.WorkerCapabilities:
        c = self.config
        return p.WorkerCapabilities(
            architectures=list(c.architectures),
            system_features=list(c.system_features),
            max_concurrent_builds=c.max_builds,
            max_concurrent_evals=c.max_evals,
            eval=c.eval,
            build=c.build,
            fetch=c.fetch,
            zone=c.zone,
            endpoint=c.endpoint,
        )

    def score(self, job: p.OfferedJob) -> p.Score:
        if self.config.score is not None:
            count, size = self.config.score(self.name, job)
        else:
            count, size = missing_cost(self.name, job.paths, self.config.have_fraction)
        return p.Score(job_id=job.job_id, missing_count=count, missing_nar_size=size)

    async def run(self) -> None:
        """Connects and serves until stop(), a 4409 close or repeated 403s at the handshake."""
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
            self._drop_all()
            self.stopped_reason = self.stopped_reason or "stopped"
            self._record("stopped", reason=self.stopped_reason)

    async def stop(self) -> None:
        self._stop.set()
        ws = self._ws
        if ws is not None:
            await ws.close()
        elif self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()  # connecting or backing off: nothing to close cleanly

    async def drain(self) -> None:
        """Takes no new job from now on: tells the server, stops requesting, refuses new
        assignments and gives up its held members (JobFailed aborted). Running jobs finish."""
        self.draining = True
        self._record("draining")
        if self.connected:
            await self._send(p.Draining())
        for job in self.held:
            self._release(job, "draining")
            await self._fail(job, "aborted", "worker draining")

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

    # Connection

    async def _connect_once(self) -> bool:
        """One connection, until it closes. True if it got as far as an InitAck."""
        url = self.url
        try:
            async with connect(
                url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                open_timeout=self.config.open_timeout,
                max_size=p.MAX_FRAME_BYTES,
                compression=None,  # a zlib context per connection is too heavy for a fleet
                proxy=None,
            ) as ws:
                self._ws = ws
                self._record("connected", url=url)
                sessions = self.connections
                try:
                    await self._serve(ws)
                finally:
                    self._ws = None
                    self._disconnected(ws)
                return self.connections > sessions
        except InvalidStatus as exc:
            status = exc.response.status_code
            self._record("connect_failed", url=url, error=f"HTTP {status}")
            if status == 403:
                self.forbidden += 1
                if self.forbidden > self.config.forbidden_retries:
                    self._finish("forbidden")
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

    def _disconnected(self, ws: ClientConnection) -> None:
        self.connected = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for job in self.held:
            self._release(job, "disconnected")
        code = ws.close_code
        self._record("disconnected", code=code, reason=ws.close_reason or None)
        if code == REPLACED_CLOSE_CODE:
            self._finish("replaced")

    def _finish(self, reason: str) -> None:
        self.stopped_reason = reason
        self._stop.set()

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
        """A job's final report; kept for the next session if it cannot go now."""
        if not (self.connected and await self._send(message)):
            self._outbox.append(message)

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
        p.AssignJob: "_on_assign",
        p.StartCluster: "_on_start",
        p.AbortCluster: "_on_abort_cluster",
        p.AbortJob: "_on_abort_job",
        p.ForwardedSignal: "_on_signal",
        p.Error: "_on_error",
    }

    async def _on_init_ack(self, ack: p.InitAck) -> None:
        self._record("init_ack", protocol=ack.protocol, heartbeat_secs=ack.heartbeat_secs)
        while self._outbox:  # reports from before the drop go first
            if not await self._send(self._outbox[0]):
                return
            self._outbox.pop(0)
        self.connected = True
        self.connections += 1
        self.forbidden = 0
        if self.draining:
            await self._send(p.Draining())
        await self._request_free_slots()
        if self._heartbeat is None:
            period = self.config.heartbeat_secs or ack.heartbeat_secs
            self._heartbeat = self._spawn(self._heartbeat_loop(period))

    async def _heartbeat_loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await self._request_free_slots()

    async def _request_free_slots(self) -> None:
        for kind in ("eval", "build"):
            for _ in range(self.free_slots(kind)):
                await self._request(kind)

    async def _request(self, kind: str) -> None:
        if self.connected and not self.draining:
            await self._send(p.RequestJob(kind=kind))

    async def _on_offer(self, offer: p.JobOffer) -> None:
        # Answered here, before the reader takes the next frame, so always before the next
        # RequestJob this worker sends.
        if self.config.score_secs:
            await asyncio.sleep(self.config.score_secs)
        await self._send(p.JobScores(scores=[self.score(job) for job in offer.jobs]))

    async def _on_assign(self, assign: p.AssignJob) -> None:
        hold = assign.cluster
        member = {"attempt": hold.attempt, "role": hold.role, "index": hold.index} if hold else {}
        ids = {"job_id": assign.job_id, "assignment_id": assign.assignment_id}
        self._record("assigned", **ids, **member, kind=assign.job.kind, steps=assign.job.steps)
        reason = self._refusal(assign)
        if reason is not None:
            self.rejected += 1
            await self._send(
                p.AssignJobResponse(job_id=assign.job_id, accepted=False, reason=reason)
            )
            self._record("rejected", **ids, attempt=member.get("attempt"), reason=reason)
            return
        job = Job(**ids, kind=assign.job.kind, **member)
        self.jobs[job.job_id] = job
        if hold is not None:
            loop = asyncio.get_running_loop()
            job.timer = loop.call_later(hold.hold_secs, self._hold_expired, job)
            if not self.config.answers_members:
                self._record("held", **job.ids(), role=hold.role, index=hold.index, silent=True)
                return
        await self._send(p.AssignJobResponse(job_id=job.job_id, accepted=True))
        self._record("accepted", **job.ids())
        if hold is None:
            self._start(job)
        else:
            self._record(
                "held", **job.ids(), role=hold.role, index=hold.index, hold_secs=hold.hold_secs
            )

    def _refusal(self, assign: p.AssignJob) -> str | None:
        hold = assign.cluster
        if self.draining:
            return "draining"
        if assign.job_id in self.jobs:
            return "job already held"
        try:  # its report will echo both ids: refuse now what could never be reported
            p.JobCompleted(job_id=assign.job_id, assignment_id=assign.assignment_id, elapsed_ms=0)
        except ValueError:
            return "malformed job or assignment id"
        if hold and any(job.attempt == hold.attempt for job in self.jobs.values()):
            return "already holding a member of this attempt"
        if self.free_slots(assign.job.kind) == 0:
            return f"no free {assign.job.kind} slot"
        if hold and self._rng.random() < self.config.reject_rate:
            return "simulated reject"
        return None

    async def _on_start(self, start: p.StartCluster) -> None:
        roster = [entry.model_dump() for entry in start.roster]
        members = [job for job in self.held if job.attempt == start.attempt]
        if not members:
            self._record("start_ignored", attempt=start.attempt)
            return
        for job in members:
            job.timer.cancel()
            job.roster = roster
            self._start(job)
        if self.config.signal_on_start:
            job = members[0]
            payload = {"worker": self.name, "role": job.role, "index": job.index}
            await self.send_signal(start.attempt, payload)

    async def _on_abort_cluster(self, abort: p.AbortCluster) -> None:
        for job in [job for job in self.jobs.values() if job.attempt == abort.attempt]:
            if job.running:
                await self._abort_running(job, f"cluster aborted: {abort.reason}")
            else:
                self._release(job, "abort_cluster")
                await self._request(job.kind)

    async def _on_abort_job(self, abort: p.AbortJob) -> None:
        job = self.jobs.get(abort.job_id)
        if job is None:
            self._record("abort_ignored", job_id=abort.job_id)
        elif job.running:
            await self._abort_running(job, f"job aborted: {abort.reason}")
        else:
            self._release(job, "abort_job")
            await self._fail(job, "aborted", f"job aborted: {abort.reason}")

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

    # Jobs. Whoever removes a job from self.jobs first (its run, an abort, the hold timer)
    # owns its one report, so a job is never reported twice.

    def _start(self, job: Job) -> None:
        job.running = True
        job.started_at = time.monotonic()
        self._record("started", **job.ids(), roster=job.roster)
        job.task = self._spawn(self._run(job))

    async def _run(self, job: Job) -> None:
        await asyncio.sleep(self._rng.uniform(*self.config.job_secs))
        if self.jobs.get(job.job_id) is not job:
            return
        if self._rng.random() < self.config.fail_rate:
            await self._fail(job, "transient", "simulated failure")
            return
        del self.jobs[job.job_id]
        self.completed += 1
        elapsed_ms = self._elapsed_ms(job)
        self._record("completed", **job.ids(), elapsed_ms=elapsed_ms)
        await self._report(
            p.JobCompleted(
                job_id=job.job_id, assignment_id=job.assignment_id, elapsed_ms=elapsed_ms
            )
        )
        await self._request(job.kind)

    async def _fail(self, job: Job, kind: str, error: str) -> None:
        self.jobs.pop(job.job_id, None)
        self.failed += 1
        self._record("failed", **job.ids(), kind=kind, error=error)
        await self._report(
            p.JobFailed(job_id=job.job_id, assignment_id=job.assignment_id, error=error, kind=kind)
        )
        await self._request(job.kind)

    async def _abort_running(self, job: Job, error: str) -> None:
        job.task.cancel()
        await self._fail(job, "aborted", error)

    def _release(self, job: Job, reason: str) -> None:
        """Drops a held member without running it."""
        del self.jobs[job.job_id]
        if job.timer is not None:
            job.timer.cancel()
        self._record("released_hold", **job.ids(), reason=reason)

    def _hold_expired(self, job: Job) -> None:
        if self.jobs.get(job.job_id) is job and not job.running:
            self._release(job, "timeout")
            self._spawn(self._fail(job, "aborted", HOLD_TIMED_OUT))

    def _drop_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.timer is not None:
                job.timer.cancel()
            if job.task is not None:
                job.task.cancel()
        self.jobs.clear()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    def _elapsed_ms(job: Job) -> int:
        return int((time.monotonic() - job.started_at) * 1000)

    def _record(self, event: str, **fields) -> None:
        entry = {"time": _now(), "worker": self.name, "event": event, **fields}
        self.events.append(entry)
        if self.log is not None:
            self.log.write(entry)


class Fleet:
    """Runs many SimulatedWorkers on the current loop, from (name, token, config) triples.
    With several server URLs, worker i starts on URL i (modulo their number) and moves on to
    the next one whenever it reconnects, so the fleet is spread over the servers."""

    def __init__(
        self,
        members: Iterable[tuple[str, str, WorkerConfig]],
        url: str | Sequence[str] = DEFAULT_URL,
        log_path: str | None = None,
        ramp_secs: float = 0.0,  # spread the first connections over this long
    ):
        urls = server_urls(url)
        self.log = EventLog(log_path) if log_path else None
        self.workers = [
            SimulatedWorker(name, token, config, url=rotated(urls, i), log=self.log)
            for i, (name, token, config) in enumerate(members)
        ]
        self.ramp_secs = ramp_secs
        self.started_at = time.monotonic()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Asks run() to stop every worker and return; safe from a signal handler."""
        self._stop.set()

    async def run(self, duration: float | None = None) -> None:
        """Runs until stop(), `duration` seconds, or every worker having stopped for good."""
        self.started_at = time.monotonic()
        tasks = [asyncio.create_task(self._launch(i, w)) for i, w in enumerate(self.workers)]
        all_done = asyncio.gather(*tasks, return_exceptions=True)
        stopped = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait(
                {all_done, stopped}, timeout=duration, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
            await self._shutdown(tasks)
            if self.log is not None:
                self.log.close()

    async def _launch(self, i: int, worker: SimulatedWorker) -> None:
        if self.ramp_secs and self.workers:
            await asyncio.sleep(self.ramp_secs * i / len(self.workers))
        await worker.run()

    async def _shutdown(self, tasks: list[asyncio.Task]) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        _, late = await asyncio.wait(tasks, timeout=5)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started_at

    def counters(self) -> dict[str, int]:
        c = dict.fromkeys(COUNTERS, 0)
        c["workers"] = len(self.workers)
        for w in self.workers:
            c["connected"] += w.connected
            c["idle"] += w.connected and not w.jobs
            c["held"] += len(w.held)
            c["running"] += len(w.running)
            c["completed"] += w.completed
            c["failed"] += w.failed
            c["rejected"] += w.rejected
            c["stopped"] += w.stopped_reason is not None
        return c
