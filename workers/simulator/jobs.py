"""What a simulated worker does with its assignments: it holds cluster members until
StartCluster, runs jobs, and reports each exactly once. Whoever removes a job from `jobs` first
(its run, an abort, the hold timer) owns its one report, so a job is never reported twice."""

import asyncio
import time
from dataclasses import dataclass

from gradient.wire import protocol as p

HOLD_TIMED_OUT = "cluster start timed out"


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


class Jobs:
    """SimulatedWorker's assignments, held or running (a mixin: the connection half, in
    workers.simulator.worker, sends, records and spawns for it)."""

    @property
    def held(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.attempt is not None and not job.running]

    @property
    def running(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.running]

    def free_slots(self, kind: str) -> int:
        used = sum(1 for job in self.jobs.values() if job.kind == kind)
        return max(self.config.slots(kind) - used, 0)

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
        if self.config.loses_members:
            # A flaky machine: the connection drops with its members held, as a crash would.
            self._record("losing_members", attempt=start.attempt)
            self._drop_connection()
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

    @staticmethod
    def _elapsed_ms(job: Job) -> int:
        return int((time.monotonic() - job.started_at) * 1000)
