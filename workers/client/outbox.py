"""A worker's final reports not yet sent, oldest first. They survive a lost connection and go
out, in order and each once, as soon as a session is up (after its InitAck)."""

import asyncio
from collections.abc import Awaitable, Callable

from gradient.wire import protocol as p


class Outbox:
    def __init__(self, sent: asyncio.Event):
        self._reports: list[p.Message] = []
        self._sending = asyncio.Lock()  # one sender at a time: no report goes twice
        self._sent = sent  # set whenever one went out

    def __len__(self) -> int:
        return len(self._reports)

    def ids(self) -> list[p.RunningJob]:
        """The assignments these reports are of: still the worker's until they are sent."""
        return [p.RunningJob(job_id=r.job_id, assignment_id=r.assignment_id) for r in self._reports]

    def add(self, report: p.Message) -> None:
        self._reports.append(report)

    async def flush(self, send: Callable[[p.Message], Awaitable[bool]]) -> None:
        """Sends from the oldest until done or `send` fails (no session: they wait)."""
        async with self._sending:
            while self._reports and await send(self._reports[0]):
                self._reports.pop(0)
                self._sent.set()
