"""The /proto session: authenticate at the handshake, then per frame parse, call one service,
reply. Transactions live in the services, never across awaits; state lives in PostgreSQL."""

import contextlib

from autobahn.exception import Disconnected
from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from clusters import coordinator
from gradient import metrics
from gradient.errors import NotAllowed
from gradient.wire import protocol as wire
from sessions import connection, reports
from sessions.frame_queue import OfferAll, Touch
from sessions.lanes import Lanes
from sessions.presence import Presence
from sessions.rate_limit import TokenBucket
from sessions.requests import Requests
from sessions.starts import SessionStart
from sessions.threads import accept_db, handshake_db, report_db

CLOSE_TOO_BIG = 1009  # daphne sends it itself (gradient/asgi.py): this is for other servers
# A frame failed: the session ends (its lane dropped the rest) and the worker reconnects. As
# HTTP's 500; autobahn lets an application send only 1000 or 3000-4999.
CLOSE_ERROR = 4500
CLOSE_REVOKED = 4403
CLOSE_SILENT = 4408
CLOSE_REPLACED = 4409


class WorkerConsumer(AsyncWebsocketConsumer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worker_id: int | None = None
        self.ready = False  # its capabilities recorded, InitAck sent
        self.live = True  # not revoked, replaced or silent
        self.starting = SessionStart()
        # Once authenticated:
        self.bucket: TokenBucket | None = None
        self.presence: Presence | None = None
        self.requests: Requests | None = None
        self.lanes: Lanes | None = None

    async def dispatch(self, message):
        # Channels' own dispatch hops to the one thread-sensitive thread before every event (to
        # close stale connections), and every session queues for it; our threads check theirs.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def connect(self):
        with self.starting.ended_if_failed():
            token = connection.bearer_token(self.scope["headers"])
            worker = await handshake_db(connection.authenticate)(token)
            if worker is None:
                await self.close()  # before accept: the handshake is refused with 403
                return
            self.starting.begin()
            self.worker_id, name = worker
            rate = settings.GRADIENT
            self.bucket = TokenBucket(rate["WORKER_RATE_PER_SEC"], rate["WORKER_RATE_BURST"])
            self.presence = Presence(self.channel_layer, self.worker_id, name, self.channel_name)
            self.requests = Requests(self.worker_id, self.reply, lambda f: self.lanes.put(f))
            self.lanes = Lanes(f"worker {name}", self.handle, self.failed, self.requests)
            # Accepted once the token is good: the rest may outlast daphne's handshake timeout.
            await self.accept()
            await self.presence.attach()  # before any frame: frames wait for connect() to return

    async def disconnect(self, code):
        self.starting.end()
        if self.worker_id is not None:
            await self.lanes.stop()
            await self.presence.detach(code)

    async def reply(self, message: wire.Message):
        await self.send_frame(message.frame())

    async def send_frame(self, text: str):
        # The worker may have gone before daphne noted it: its disconnect follows, no crash.
        with contextlib.suppress(Disconnected):
            await self.send(text_data=text)

    async def error(self, code: str, text: str):
        await self.reply(wire.Error(code=code, message=text))

    async def end(self, code: int):
        self.live = False
        await self.close(code=code)

    async def receive(self, text_data=None, bytes_data=None):
        data = text_data.encode() if text_data is not None else (bytes_data or b"")
        if len(data) > wire.MAX_FRAME_BYTES:
            await self.close(code=CLOSE_TOO_BIG)
            return
        if not self.bucket.take():
            await self.error("rate_limited", "too many frames; slow down")
            return
        try:
            message = wire.parse_inbound(data)
        except wire.ProtocolError as exc:
            await self.error("bad_message", str(exc))
            return
        if not self.ready and not isinstance(message, wire.WorkerCapabilities):
            await self.error("bad_message", "the first frame must be WorkerCapabilities")
            return
        if self.ready:
            await self.starting.wait_for_calm()
        if touch := self.presence.due():
            self.lanes.put(touch)
        if isinstance(message, wire.WorkerCapabilities):
            await self.handle(message)  # the start path: InitAck, then the offer (queued)
        else:
            self.lanes.put(message)
        self.requests.heard(message)

    async def handle(self, message):
        if not self.live:
            return  # revoked, replaced or silent: closing
        owner = self.requests if isinstance(message, Requests.FRAMES) else self
        try:
            await getattr(owner, f"on_{type(message).__name__}")(message)
        except NotAllowed as exc:
            await self.error("not_allowed", str(exc))

    async def failed(self, _message):
        await self.close(code=CLOSE_ERROR)

    # Frames from the worker, and the session's touches (the single path's: Requests)

    async def on_Touch(self, touch: Touch):
        if not await self.presence.touch(touch):
            await self.end(CLOSE_REVOKED)

    async def on_WorkerCapabilities(self, caps: wire.WorkerCapabilities):
        worker, closed = await self.presence.record(caps)
        self.requests.ready(worker, caps)
        self.ready = True
        await self.reply(wire.InitAck(worker=worker.name))
        for job in closed:
            await self.reply(wire.AbortJob(job_id=job.job_id, reason="no longer assigned here"))
        self.starting.end()
        # Through the bulk lane, ahead of the RequestJobs that follow, with the row just written.
        self.lanes.put(OfferAll(worker))

    async def on_AssignJobResponse(self, response: wire.AssignJobResponse):
        # A member's answer on the acceptances' threads: its attempt's seats wait for it. A
        # single job this session gave out stays on the reports' (more threads cost the GIL).
        run = report_db if self.requests.forget(response.job_id) else accept_db
        if response.accepted:
            await run(reports.job_accepted)(self.worker_id, response.job_id)
        else:
            await run(reports.job_rejected)(self.worker_id, response.job_id, response.reason)

    async def on_JobCompleted(self, report: wire.JobCompleted):
        self.requests.forget(report.job_id)  # a job never answered leaves no entry behind
        done = (report.job_id, report.assignment_id, report.log_tail)
        await report_db(reports.job_completed)(self.worker_id, *done)

    async def on_JobFailed(self, report: wire.JobFailed):
        self.requests.forget(report.job_id)
        failure = (report.job_id, report.assignment_id, report.kind, report.error, report.log_tail)
        await report_db(reports.job_failed)(self.worker_id, *failure)

    async def on_ClusterSignal(self, signal: wire.ClusterSignal):
        sent = (signal.attempt, signal.to, signal.payload)
        try:
            await report_db(coordinator.forward_signal)(self.worker_id, *sent)
        except NotAllowed:
            await report_db(metrics.count_signal_dropped)()
            raise

    async def on_Draining(self, _: wire.Draining):
        await report_db(connection.start_draining)(self.worker_id)
        self.requests.draining()

    # Messages from other processes, through the worker's group

    async def worker_send(self, event):  # from a pass (dispatch, coordinator)
        if self.live:
            await self.send_frame(event["frame"])

    async def worker_offer(self, event):  # members the pass could seat here: the scores wake it
        if self.live:
            self.requests.asked = True
            await self.send_frame(event["frame"])

    async def worker_revoked(self, event):
        await self.end(CLOSE_REVOKED)

    async def worker_silent(self, event):
        await self.end(CLOSE_SILENT)

    async def session_replaced(self, event):
        await self.end(CLOSE_REPLACED)
