"""The reference worker: the protocol client (workers.client) whose run is a timer that may
fail at a chosen rate and whose store is a stable hash (workers.simulator.store)."""

import asyncio
import contextlib
from collections.abc import Sequence

from gradient.wire import protocol as p
from workers.client import (
    DEFAULT_URL,
    REPLACED_CLOSE_CODE,
    EventLog,
    Job,
    Outcome,
    Worker,
    rotated,
    server_urls,
)
from workers.simulator.config import WorkerConfig
from workers.simulator.store import missing_cost

__all__ = [
    "DEFAULT_URL",
    "REPLACED_CLOSE_CODE",
    "EventLog",
    "SimulatedWorker",
    "rotated",
    "server_urls",
]


class SimulatedWorker(Worker):
    """One simulated worker: a connection loop that reconnects with backoff, and the jobs it
    holds or runs, each a timer. Its faults (refusals, silence, lost members) are the
    config's."""

    def __init__(
        self,
        name: str,
        token: str,
        config: WorkerConfig | None = None,
        url: str | Sequence[str] = DEFAULT_URL,
        log: EventLog | None = None,
    ):
        super().__init__(name, token, config or WorkerConfig(), url, log)

    def score(self, job: p.OfferedJob) -> p.Score:
        if self.config.score is not None:
            count, size = self.config.score(self.name, job)
        else:
            count, size = missing_cost(self.name, job.paths, self.config.have_fraction)
        return p.Score(job_id=job.job_id, missing_count=count, missing_nar_size=size)

    async def _scores(self, jobs: list[p.OfferedJob]) -> list[p.Score]:
        if self.config.score_secs:
            await asyncio.sleep(self.config.score_secs)
        return [self.score(job) for job in jobs]

    async def _execute(self, job: Job) -> Outcome:
        self._started(job)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._rng.uniform(*self.config.job_secs)):
                await job.aborted.wait()
        elapsed_ms = self._elapsed_ms(job)
        if job.abort_error is not None:
            return Outcome(False, "aborted", job.abort_error, elapsed_ms)
        if self._rng.random() < self.config.fail_rate:
            return Outcome(False, "transient", "simulated failure", elapsed_ms)
        return Outcome(True, elapsed_ms=elapsed_ms)

    def _refusal(self, assign: p.AssignJob) -> str | None:
        reason = super()._refusal(assign)
        if reason is None and assign.cluster and self._rng.random() < self.config.reject_rate:
            return "simulated reject"
        return reason

    def _answers(self, job: Job) -> bool:
        return self.config.answers_members

    async def _on_start(self, start: p.StartCluster) -> None:
        members = [job for job in self.held if job.attempt == start.attempt]
        if members and self.config.loses_members:
            # A flaky machine: the connection drops with its members held, as a crash would.
            self._record("losing_members", attempt=start.attempt)
            self._drop_connection()
            return
        await super()._on_start(start)
        if members and self.config.signal_on_start:
            job = members[0]
            payload = {"worker": self.name, "role": job.role, "index": job.index}
            await self.send_signal(start.attempt, payload)
