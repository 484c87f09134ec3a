"""The /proto session: authenticate at the handshake, then per frame parse, call one service,
reply. Transactions live in the services (run in a thread by database_sync_to_async), never
across awaits; state lives in PostgreSQL, so any number of daphne processes can serve."""

import asyncio
import contextlib
import logging
import time

from autobahn.exception import Disconnected
from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from clusters import coordinator
from clusters.wake import wake_dispatch
from gradient import metrics
from gradient.errors import NotAllowed
from gradient.logs import ids
from gradient.wire.groups import worker_group
from gradient.wire.protocol import (
    MAX_FRAME_BYTES,
    AbortJob,
    AssignJobResponse,
    ClusterSignal,
    Draining,
    Error,
    InitAck,
    JobCompleted,
    JobFailed,
    JobScores,
    Message,
    ProtocolError,
    RequestJob,
    WorkerCapabilities,
    parse_inbound,
)
from sessions import connection, reports
from sessions.connection import bearer_token
from sessions.frame_queue import FrameQueue, OfferAll, ScoresLate, Touch
from sessions.rate_limit import TokenBucket
from sessions.request_job import answer_request, read_and_answer, read_head
from sessions.starts import STARTS_FIRST_SECS, Starts, leave_replaced, session_starts
from sessions.threads import accept_db, db, handshake_db, report_db
from workers import liveness, offers

log = logging.getLogger(__name__)

# Over daphne, a frame past its (and our) 1 MiB limit never reaches the consumer: autobahn
# closes with 1009 itself (with a close frame: gradient/asgi.py). This check is for any other
# server, or a daphne started with a larger limit.
CLOSE_TOO_BIG = 1009
# A frame's handling failed: the session ends (its lane would drop every later frame) and the
# worker reconnects. 4500, as HTTP's 500: autobahn lets an application send only 1000 or
# 3000-4999, not 1011.
CLOSE_ERROR = 4500
CLOSE_REVOKED = 4403
CLOSE_SILENT = 4408
CLOSE_REPLACED = 4409
# A session joins its group again this often (a Redis restart empties the groups), and writes
# its liveness every workers.liveness.touch_every() seconds, at the touch that follows.
TOUCH_EVERY_SECS = 5.0


# Frames whose work is the bulk of a session's: offers, scores and requests for work. They wait
# in a queue of the session's own, handled in order by a task of its own, so that the frames
# after them (an AssignJobResponse, a report) and the passes' frames to the worker (an
# AssignJob, a StartCluster) never wait for them.
BULK = (RequestJob, JobScores)


class WorkerConsumer(AsyncWebsocketConsumer):
    worker_id: int | None = None

    async def dispatch(self, message):
        # Channels' own dispatch first closes the stale database connections of the process's
        # one thread-sensitive thread, for every frame and every event of every session: a
        # hop to that thread which all of them queue for. This consumer never uses that
        # thread's connection; its services run on their own threads (db(), handshake_db()),
        # which check their connections before and after each call.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    starting = False  # authenticated, InitAck not sent yet (see STARTS_FIRST_SECS)

    def start_began(self):
        # Counted for STARTS_FIRST_SECS at most: a worker that never sends its capabilities
        # must not hold the other sessions' frames back for longer.
        self.starting = True
        starts = session_starts()
        starts.begin()
        asyncio.get_running_loop().call_later(STARTS_FIRST_SECS, self.start_ended, starts)

    def start_ended(self, starts: "Starts | None" = None):
        if self.starting:
            self.starting = False
            (starts or session_starts()).end()

    async def connect(self):
        try:
            await self.start()
        except BaseException:
            self.start_ended()
            raise

    async def start(self):
        worker = await handshake_db(connection.authenticate)(bearer_token(self.scope["headers"]))
        if worker is None:
            await self.close()  # before accept: the handshake is refused with 403
            return
        self.start_began()
        self.worker_id, self.worker_name = worker
        self.ready = False
        self.worker = None  # its row, from its capabilities
        self.offered = offers.Offered()  # the single jobs offered on this connection
        self.head: offers.Head | None = None  # what the last offer read
        # RequestJobs waiting for the worker's scores of the offer made for them.
        self.awaiting: list[str] = []
        self.offers_made = 0
        self.asked = False  # the dispatch pass offered members: their scores wake it
        self.singles: set[str] = set()  # single jobs given out, not yet answered
        # Kinds whose last RequestJob got an idle slot, with no report since: the next one is
        # a resend, and refreshes the slot (workers.assignment.record_idle).
        self.idle: set[str] = set()
        self.accepts = FrameQueue(f"worker {self.worker_name} accepts", self.handle, self.failed)
        self.reports = FrameQueue(f"worker {self.worker_name} reports", self.handle, self.failed)
        self.bulk = FrameQueue(f"worker {self.worker_name} bulk", self.handle, self.failed)
        self.last_accept: asyncio.Future | None = None
        self.last_report: asyncio.Future | None = None
        self.replacing: asyncio.Future | None = None  # telling the session this one replaces
        self.slots = {"eval": 0, "build": 0}  # from the capabilities
        self.live = True
        self.touched = self.seen = 0.0  # set once attached: attach() is as good as a touch
        self.touch_every = liveness.touch_every()
        self.bucket = TokenBucket(
            settings.GRADIENT["WORKER_RATE_PER_SEC"], settings.GRADIENT["WORKER_RATE_BURST"]
        )
        # Accepted as soon as the token is known good: the rest of the start can take longer
        # than daphne waits for a handshake (5 s) when every worker connects at once, and the
        # worker's frames wait until connect() returns, so none is handled before attach().
        await self.accept()
        async with session_starts().gate:
            await self.join_group()
            previous, self.unsettled = await handshake_db(connection.attach)(
                self.worker_id, self.channel_name
            )
        self.touched = self.seen = time.monotonic()
        if previous and previous != self.channel_name:
            # Off the start's path: after a restart every session replaces a dead one.
            self.replacing = asyncio.ensure_future(
                leave_replaced(self.channel_layer, self.worker_id, self.worker_name, previous)
            )
        log.info("worker %s connected", self.worker_name, extra=ids(worker=self.worker_id))

    async def disconnect(self, code):
        self.start_ended()
        if self.worker_id is None:
            return
        # The start path first: a report may wait for an acceptance, a bulk frame for a report.
        await self.accepts.stop()
        await self.reports.stop()
        await self.bulk.stop()
        await self.channel_layer.group_discard(worker_group(self.worker_id), self.channel_name)
        if await db(connection.detach)(self.worker_id, self.channel_name):
            log.info(
                "worker %s disconnected (%s)",
                self.worker_name,
                code,
                extra=ids(worker=self.worker_id),
            )

    async def reply(self, message: Message):
        await self.send_frame(message.frame())

    async def send_frame(self, text: str):
        # The worker may have gone while the frame was being made, before daphne noted the
        # close: its websocket.disconnect follows (and detaches the session), so no crash.
        with contextlib.suppress(Disconnected):
            await self.send(text_data=text)

    async def error(self, code: str, text: str):
        await self.reply(Error(code=code, message=text))

    async def receive(self, text_data=None, bytes_data=None):
        data = text_data.encode() if text_data is not None else (bytes_data or b"")
        if len(data) > MAX_FRAME_BYTES:
            await self.close(code=CLOSE_TOO_BIG)
            return
        if not self.bucket.take():
            await self.error("rate_limited", "too many frames; slow down")
            return
        try:
            message = parse_inbound(data)
        except ProtocolError as exc:
            await self.error("bad_message", str(exc))
            return
        if not self.ready and not isinstance(message, WorkerCapabilities):
            await self.error("bad_message", "the first frame must be WorkerCapabilities")
            return
        if self.ready and not self.starting:
            await session_starts().wait_for_calm()
        self.check_liveness()
        if isinstance(message, WorkerCapabilities):
            await self.handle(message)  # the start path: InitAck, then the offer (queued)
        elif isinstance(message, BULK):
            self.queue_bulk(message)
        elif isinstance(message, AssignJobResponse) and message.job_id not in self.singles:
            # A member's answer holds its whole attempt: it does not wait for this worker's
            # reports before it (a completion settles a job: seconds on a loaded host). The
            # reports after it wait for it, so each job's frames stay in order.
            self.last_accept = self.accepts.put(message)
        else:
            self.last_report = self.reports.put(message, after=self.last_accept)
        if not isinstance(message, BULK):
            self.idle.clear()  # a job answered or ended: the next RequestJob may be new

    async def handle(self, message):
        if not self.live:
            return  # revoked, replaced or silent: closing
        handler = getattr(self, f"on_{type(message).__name__}")
        try:
            await handler(message)
        except NotAllowed as exc:
            await self.error("not_allowed", str(exc))

    async def failed(self, _message):
        await self.close(code=CLOSE_ERROR)

    def queue_bulk(self, message):
        """Queue a bulk frame behind the reports that arrived before it (a JobCompleted
        frees the slot that the RequestJob after it asks to fill). A RequestJob while as many
        of its kind as the worker has slots of that kind already wait is a resend (one every
        10 s per free slot): dropped, the waiting ones will answer."""
        if isinstance(message, RequestJob):
            kind = message.kind
            waiting = self.bulk.waiting(lambda m: isinstance(m, RequestJob) and m.kind == kind)
            if waiting and waiting >= self.slots.get(kind, 0):
                return
        self.bulk.put(message, after=self.last_report)

    def check_liveness(self):
        """A touch every few seconds of frames, queued with the bulk frames: the group joined
        again and, every touch_every() seconds, liveness written (the bulk frames after it ask
        for work, which a session that lost must not get): the same query notices a revoked
        token or a newer session that took over, and the session closes. Not with the
        reports: a touch per session every few seconds would be most of them."""
        now = time.monotonic()
        if now - self.touched >= TOUCH_EVERY_SECS:
            self.touched = now
            write = now - self.seen >= self.touch_every
            if write:
                self.seen = now
            self.bulk.put(Touch(liveness=write))

    async def on_Touch(self, touch: "Touch"):
        if touch.liveness and not await db(connection.touch)(self.worker_id, self.channel_name):
            self.live = False
            await self.close(code=CLOSE_REVOKED)
            return
        await self.join_group()

    async def join_group(self):
        """At the start, and again at every touch: the worker's group lives in Redis, and the
        session outlives it: a Redis restart empties every group, and channels-redis drops a
        member after its group_expiry (a day). Either way the passes could no longer reach a
        live session. Joining again is idempotent; a failure (Redis down or too slow, as in a
        storm on a starved machine) is retried at the next touch, and the session goes on:
        Redis carries only wake-ups."""
        try:
            await self.channel_layer.group_add(worker_group(self.worker_id), self.channel_name)
        except Exception:
            log.warning("worker %s could not join its group", self.worker_name, exc_info=True)

    # Frames from the worker

    async def on_WorkerCapabilities(self, caps: WorkerCapabilities):
        # On the handshake's threads too: InitAck ends a worker's start, and must not queue
        # behind the offers and RequestJobs of the sessions already started.
        closed = []
        if self.unsettled or caps.running:  # what the worker runs from an earlier session
            self.unsettled = False
            closed = await handshake_db(connection.settle_earlier)(self.worker_id, caps.running)
        worker = await handshake_db(connection.record_capabilities)(self.worker_id, caps)
        self.worker = worker
        self.ready = True
        self.slots = {"eval": caps.max_concurrent_evals, "build": caps.max_concurrent_builds}
        await self.reply(InitAck(worker=worker.name))
        for job in closed:  # decided while the worker was away: it must not go on running
            await self.reply(AbortJob(job_id=job.job_id, reason="no longer assigned here"))
        self.start_ended()
        # The offer goes through the bulk queue, ahead of the RequestJobs that follow, with the
        # row just written (not read again). New capabilities may fit jobs the mark has
        # passed: read them all.
        self.queue_bulk(OfferAll(worker))

    async def on_OfferAll(self, offer_all: "OfferAll"):
        # Queued at InitAck, not received: it waits for calm as the worker's frames do, or a
        # storm's first offers would take PostgreSQL from the starts still under way.
        await session_starts().wait_for_calm()
        self.head = await db(read_head)(offer_all.worker, self.offered)
        if self.head.offer is not None:
            await self.reply(self.head.offer)

    async def on_RequestJob(self, request: RequestJob):
        # The single path chooses by the scores of the head: a request that comes with new
        # offers is answered once the worker has scored them, or when they are late.
        if self.awaiting:
            if self.awaiting.count(request.kind) < self.slots.get(request.kind, 0):
                self.awaiting.append(request.kind)
            return
        kind = request.kind
        self.head, answered, assign = await db(read_and_answer)(
            self.worker, self.offered, kind, kind in self.idle
        )
        if answered:
            await self.answered(kind, assign)
            return
        await self.reply(self.head.offer)
        wait = settings.GRADIENT["SCORE_WAIT_MS"] / 1000
        if wait:
            self.awaiting.append(kind)
            self.offers_made += 1
            later = ScoresLate(self.offers_made)
            asyncio.get_running_loop().call_later(wait, self.bulk.put, later)
            return
        await self.answer(kind)

    async def on_ScoresLate(self, late: "ScoresLate"):
        if late.offer == self.offers_made:
            await self.answer_awaiting()

    async def answer_awaiting(self):
        kinds, self.awaiting = self.awaiting, []
        for kind in kinds:
            await self.answer(kind)

    async def answer(self, kind: str):
        head = self.head.singles[kind] if self.head is not None else None
        sizes = dict(self.offered.sizes)
        resend = kind in self.idle
        assign = await db(answer_request)(self.worker_id, kind, self.worker, head, sizes, resend)
        await self.answered(kind, assign)

    async def answered(self, kind: str, assign):
        if assign is None:
            self.idle.add(kind)
            return
        self.idle.discard(kind)
        self.singles.add(assign.job_id)  # before the worker can answer it
        await self.reply(assign)

    async def on_JobScores(self, scores: JobScores):
        # One row per job: a job scored twice in one frame keeps its last score (PostgreSQL
        # refuses an upsert that touches one row twice).
        latest = list({score.job_id: score for score in scores.scores}.values())
        members = self.offered.record(latest)
        if members:
            await db(offers.record_scores)(self.worker_id, members)
        if self.awaiting:
            await self.answer_awaiting()
        if self.asked:  # the pass waits for these scores to place a cluster
            self.asked = False
            await db(wake_dispatch)()

    async def on_AssignJobResponse(self, response: AssignJobResponse):
        # A member's answer on the acceptances' threads: its attempt's seats wait for it. A
        # single job this session gave out stays on the reports' (more threads cost the GIL).
        single = response.job_id in self.singles
        self.singles.discard(response.job_id)
        run = report_db if single else accept_db
        if response.accepted:
            await run(reports.job_accepted)(self.worker_id, response.job_id)
        else:
            await run(reports.job_rejected)(self.worker_id, response.job_id, response.reason)

    async def on_JobCompleted(self, report: JobCompleted):
        self.singles.discard(report.job_id)  # a job never answered leaves no entry behind
        await report_db(reports.job_completed)(
            self.worker_id, report.job_id, report.assignment_id, report.log_tail
        )

    async def on_JobFailed(self, report: JobFailed):
        self.singles.discard(report.job_id)
        await report_db(reports.job_failed)(
            self.worker_id,
            report.job_id,
            report.assignment_id,
            report.kind,
            report.error,
            report.log_tail,
        )

    async def on_ClusterSignal(self, signal: ClusterSignal):
        try:
            await report_db(coordinator.forward_signal)(
                self.worker_id, signal.attempt, signal.to, signal.payload
            )
        except NotAllowed:
            await report_db(metrics.count_signal_dropped)()
            raise

    async def on_Draining(self, _: Draining):
        await report_db(connection.start_draining)(self.worker_id)
        if self.worker is not None:
            self.worker.draining = True

    # Messages from other processes, through the worker's group

    async def worker_send(self, event):
        """A pass (dispatch, coordinator) sends a frame to this worker."""
        if self.live:
            await self.send_frame(event["frame"])

    async def worker_offer(self, event):
        """The dispatch pass offers this idle worker the members of a cluster it could seat:
        the answer wakes the pass, which places the cluster on it."""
        if self.live:
            self.asked = True
            await self.send_frame(event["frame"])

    async def worker_revoked(self, event):
        self.live = False
        await self.close(code=CLOSE_REVOKED)

    async def worker_silent(self, event):
        self.live = False
        await self.close(code=CLOSE_SILENT)

    async def session_replaced(self, event):
        self.live = False
        await self.close(code=CLOSE_REPLACED)
