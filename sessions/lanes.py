"""A session's three lanes of frames (sessions/frame_queue.py): a member's acceptance waits for
nothing, a report for the last acceptance before it, a bulk frame for the last report before
it, so that no frame overtakes an earlier one it may depend on."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gradient.wire.protocol import AssignJobResponse, JobScores, RequestJob
from sessions.frame_queue import FrameQueue, OfferAll, ScoresLate, Touch

if TYPE_CHECKING:
    from sessions.requests import Requests

# The bulk of a session's work, in a lane of their own so that the frames after them and the
# passes' frames to the worker never wait for them.
BULK = (RequestJob, JobScores)


class Lanes:
    def __init__(
        self,
        name: str,
        handle: Callable[[object], Awaitable[None]],
        failed: Callable[[object], Awaitable[None]],
        requests: "Requests",
    ):
        self.accepts = FrameQueue(f"{name} accepts", handle, failed)
        self.reports = FrameQueue(f"{name} reports", handle, failed)
        self.bulk = FrameQueue(f"{name} bulk", handle, failed)
        self.last_accept: asyncio.Future | None = None
        self.last_report: asyncio.Future | None = None
        self._requests = requests  # what the session gave out, and the worker's slots

    def put(self, frame) -> None:
        if isinstance(frame, (Touch, ScoresLate)):
            self.bulk.put(frame)  # the session's own: it answers to no report
        elif isinstance(frame, (*BULK, OfferAll)):
            self._put_bulk(frame)
        elif isinstance(frame, AssignJobResponse) and not self._requests.single(frame.job_id):
            # A member's answer holds its whole attempt: it waits for no report; the reports
            # after it wait for it, so each job's frames stay in order.
            self.last_accept = self.accepts.put(frame)
        else:
            self.last_report = self.reports.put(frame, after=self.last_accept)

    def _put_bulk(self, frame) -> None:
        """Behind the reports that arrived before it: a JobCompleted frees the slot the next
        RequestJob asks to fill. A RequestJob beyond the worker's slots of its kind already
        waiting is a resend: dropped, the waiting ones will answer."""
        if isinstance(frame, RequestJob):
            kind = frame.kind
            waiting = self.bulk.waiting(lambda m: isinstance(m, RequestJob) and m.kind == kind)
            if waiting and waiting >= self._requests.slots_of(kind):
                return
        self.bulk.put(frame, after=self.last_report)

    async def stop(self) -> None:
        # The start path first: a report may wait for an acceptance, a bulk frame for a report.
        await self.accepts.stop()
        await self.reports.stop()
        await self.bulk.stop()
