"""A session's RequestJobs, from the frame to its AssignJob or idle slot: the head offered and
scored, the requests that wait for those scores (or for GRADIENT_SCORE_WAIT_MS), the kinds
whose last answer was an idle slot, and the single jobs given out. Why a worker did or did not
get a single job is decided here and in the services it calls (sessions.request_job)."""

import asyncio
from collections.abc import Awaitable, Callable

from django.conf import settings

from clusters.wake import wake_dispatch
from gradient.wire.protocol import JobScores, Message, RequestJob, WorkerCapabilities
from sessions.frame_queue import OfferAll, ScoresLate
from sessions.request_job import answer_request, read_and_answer, read_head
from sessions.starts import session_starts
from sessions.threads import db
from workers import offers


class Requests:
    # The frames of the single path, each handled by the method of its name.
    FRAMES = (RequestJob, JobScores, OfferAll, ScoresLate)

    def __init__(
        self,
        worker_id: int,
        reply: Callable[[Message], Awaitable[None]],
        queue: Callable[[object], None],
    ):
        self.worker_id = worker_id
        self.worker = None  # its row, from its capabilities
        self.slots = {"eval": 0, "build": 0}  # from the capabilities
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
        self._reply = reply
        self._queue = queue  # onto the session's bulk lane, where requests are handled

    def ready(self, worker, caps: WorkerCapabilities) -> None:
        """The worker's capabilities are recorded: its row and its slots."""
        self.worker = worker
        self.slots = {"eval": caps.max_concurrent_evals, "build": caps.max_concurrent_builds}

    def slots_of(self, kind: str) -> int:
        return self.slots.get(kind, 0)

    def single(self, job_id: str) -> bool:
        return job_id in self.singles

    def forget(self, job_id: str) -> bool:
        """A job answered or reported: no longer given out. Whether it was a single job."""
        single = job_id in self.singles
        self.singles.discard(job_id)
        return single

    def heard(self, message) -> None:
        if not isinstance(message, (RequestJob, JobScores)):
            self.idle.clear()  # a job answered or ended: the next RequestJob may be new

    def draining(self) -> None:
        if self.worker is not None:
            self.worker.draining = True

    async def on_OfferAll(self, offer_all: OfferAll) -> None:
        """The first offer, of every kind: new capabilities may fit jobs the mark has passed.
        Queued at InitAck, not received, it waits for calm as the worker's frames do, or a
        storm's first offers would take PostgreSQL from the starts still under way."""
        await session_starts().wait_for_calm()
        self.head = await db(read_head)(offer_all.worker, self.offered)
        if self.head.offer is not None:
            await self._reply(self.head.offer)

    async def on_RequestJob(self, request: RequestJob) -> None:
        # The single path chooses by the scores of the head: a request that comes with new
        # offers is answered once the worker has scored them, or when they are late.
        kind = request.kind
        if self.awaiting:
            if self.awaiting.count(kind) < self.slots_of(kind):
                self.awaiting.append(kind)
            return
        self.head, answered, assign = await db(read_and_answer)(
            self.worker, self.offered, kind, kind in self.idle
        )
        if answered:
            await self._give(kind, assign)
            return
        await self._reply(self.head.offer)
        wait = settings.GRADIENT["SCORE_WAIT_MS"] / 1000
        if wait:
            self.awaiting.append(kind)
            self.offers_made += 1
            later = ScoresLate(self.offers_made)
            asyncio.get_running_loop().call_later(wait, self._queue, later)
            return
        await self._answer(kind)

    async def on_ScoresLate(self, late: ScoresLate) -> None:
        if late.offer == self.offers_made:  # not an earlier offer's, answered already
            await self._answer_awaiting()

    async def on_JobScores(self, scores: JobScores) -> None:
        # One row per job: a job scored twice in one frame keeps its last score (PostgreSQL
        # refuses an upsert that touches one row twice).
        latest = list({score.job_id: score for score in scores.scores}.values())
        members = self.offered.record(latest)
        if members:
            await db(offers.record_scores)(self.worker_id, members)
        if self.awaiting:
            await self._answer_awaiting()
        if self.asked:  # the pass waits for these scores to place a cluster
            self.asked = False
            await db(wake_dispatch)()

    async def _answer_awaiting(self) -> None:
        kinds, self.awaiting = self.awaiting, []
        for kind in kinds:
            await self._answer(kind)

    async def _answer(self, kind: str) -> None:
        head = self.head.singles[kind] if self.head is not None else None
        sizes = dict(self.offered.sizes)
        resend = kind in self.idle
        assign = await db(answer_request)(self.worker_id, kind, self.worker, head, sizes, resend)
        await self._give(kind, assign)

    async def _give(self, kind: str, assign) -> None:
        if assign is None:
            self.idle.add(kind)
            return
        self.idle.discard(kind)
        self.singles.add(assign.job_id)  # before the worker can answer it
        await self._reply(assign)
