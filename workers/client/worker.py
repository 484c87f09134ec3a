"""What a worker does with its assignments: it holds cluster members until StartCluster, runs
jobs, aborts them when told, drains, and reports each exactly once. Whoever removes a job from
`jobs` first (its run, a release, the hold timer) owns its one report, so none is sent twice.

What a run is and how offers are scored are a subclass's: `_execute` and `_scores`."""

import asyncio
import time
from dataclasses import replace

from gradient.wire import protocol as p
from workers.client.connection import Connection
from workers.client.jobs import HOLD_TIMED_OUT, Job, Outcome


class Worker(Connection):
    """A protocol client with its assignments, held or running. Running jobs survive a
    reconnect (their reports wait in the outbox); held members do not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs: dict[str, Job] = {}
        self.completed = self.failed = self.rejected = 0
        self.draining = False

    @property
    def held(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.attempt is not None and not job.running]

    @property
    def running(self) -> list[Job]:
        return [job for job in self.jobs.values() if job.running]

    def free_slots(self, kind: str) -> int:
        used = sum(1 for job in self.jobs.values() if job.kind == kind)
        return max(self.config.slots(kind) - used, 0)

    async def drain(self) -> None:
        """Takes no new job from now on: tells the server, stops requesting, refuses new
        assignments and gives up its held members (JobFailed aborted). Running jobs finish."""
        if self.draining:
            return
        self.draining = True
        self._record("draining")
        if self.connected:
            await self._send(p.Draining())
        for job in self.held:
            self._release(job, "draining")
            await self._fail(job, "aborted", "worker draining")

    async def abort_running(self, error: str) -> None:
        """Aborts every running job; each reports JobFailed{aborted} once its run ends."""
        for job in self.running:
            await self._abort_running(job, error)

    # What a subclass says

    async def _execute(self, job: Job) -> Outcome:
        """Runs the job to its end (or its abort: job.aborted is set, job.abort_error says
        why). Calls self._started(job, ...) once it is under way."""
        raise NotImplementedError

    async def _interrupt(self, job: Job) -> None:
        """The run is to stop (job.aborted is set): a run that does not watch it stops here."""

    def _answers(self, job: Job) -> bool:
        """Whether an accepted assignment is answered (a hung worker holds it silently)."""
        return True

    # Hooks of the connection

    def _running_ids(self) -> list[p.RunningJob]:
        return [p.RunningJob(job_id=j.job_id, assignment_id=j.assignment_id) for j in self.running]

    def _holds_work(self) -> bool:
        return bool(self.jobs)

    def _session_lost(self) -> None:
        for job in self.held:
            self._release(job, "disconnected")

    async def _session_began(self) -> None:
        if self.draining:
            await self._send(p.Draining())

    def _shut(self) -> None:
        for job in list(self.jobs.values()):
            if job.timer is not None:
                job.timer.cancel()
            if job.task is not None:
                job.task.cancel()
        self.jobs.clear()

    async def _request(self, kind: str) -> None:
        if not self.draining:
            await super()._request(kind)

    # Server frames

    _HANDLERS = Connection._HANDLERS | {
        p.AssignJob: "_on_assign",
        p.StartCluster: "_on_start",
        p.AbortCluster: "_on_abort_cluster",
        p.AbortJob: "_on_abort_job",
    }

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
        job = Job(**ids, kind=assign.job.kind, spec=assign.job, **member)
        self.jobs[job.job_id] = job
        if hold is not None:
            loop = asyncio.get_running_loop()
            job.timer = loop.call_later(hold.hold_secs, self._hold_expired, job)
            if not self._answers(job):
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
        return None

    async def _on_start(self, start: p.StartCluster) -> None:
        roster = [entry.model_dump() for entry in start.roster]
        members = [job for job in self.held if job.attempt == start.attempt]
        if not members:
            self._record("start_ignored", attempt=start.attempt)
            return
        for job in members:
            # When StartCluster reached this member: "started" comes once its run is under way.
            self._record("start_cluster", **job.ids())
            job.timer.cancel()
            job.roster = roster
            self._start(job)

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

    # Runs

    def _start(self, job: Job) -> None:
        job.running = True
        job.started_at = time.monotonic()
        job.task = self._spawn(self._run(job))

    def _started(self, job: Job, **fields) -> None:
        self._record("started", **job.ids(), roster=job.roster, **fields)

    async def _run(self, job: Job) -> None:
        try:
            outcome = await self._execute(job)
        except Exception as exc:  # the worker's own failure, not the job's: still reported
            self._record("run_error", **job.ids(), error=repr(exc))
            error = f"the worker could not run the job: {exc}"
            outcome = Outcome(False, "transient", error, self._elapsed_ms(job))
        if self.jobs.get(job.job_id) is not job:
            return
        if job.abort_error is not None:  # the abort is what the server waits to hear of
            outcome = replace(outcome, completed=False, kind="aborted", error=job.abort_error)
        del self.jobs[job.job_id]
        ids = {"job_id": job.job_id, "assignment_id": job.assignment_id}
        tail = outcome.log_tail
        if outcome.completed:
            self.completed += 1
            self._record("completed", **job.ids(), elapsed_ms=outcome.elapsed_ms)
            await self._report(p.JobCompleted(**ids, elapsed_ms=outcome.elapsed_ms, log_tail=tail))
        else:
            self.failed += 1
            kind, error = outcome.kind, outcome.error
            self._record(
                "failed", **job.ids(), kind=kind, error=error, elapsed_ms=outcome.elapsed_ms
            )
            await self._report(p.JobFailed(**ids, error=error, kind=kind, log_tail=tail))
        await self._request(job.kind)

    async def _abort_running(self, job: Job, error: str) -> None:
        if job.abort_error is not None:
            return  # already on its way out
        job.abort_error = error
        job.aborted.set()
        self._record("aborting", **job.ids(), reason=error)
        await self._interrupt(job)

    async def _fail(self, job: Job, kind: str, error: str) -> None:
        """Reports a held member the worker gives up (it never ran)."""
        self.jobs.pop(job.job_id, None)
        self.failed += 1
        self._record("failed", **job.ids(), kind=kind, error=error)
        await self._report(
            p.JobFailed(job_id=job.job_id, assignment_id=job.assignment_id, error=error, kind=kind)
        )
        await self._request(job.kind)

    def _release(self, job: Job, reason: str) -> None:
        """Drops a held member without running it."""
        del self.jobs[job.job_id]
        if job.timer is not None:
            job.timer.cancel()
        self._changed.set()
        self._record("released_hold", **job.ids(), reason=reason)

    def _hold_expired(self, job: Job) -> None:
        if self.jobs.get(job.job_id) is job and not job.running:
            self._release(job, "timeout")
            self._spawn(self._fail(job, "aborted", HOLD_TIMED_OUT))

    @staticmethod
    def _elapsed_ms(job: Job) -> int:
        return int((time.monotonic() - job.started_at) * 1000)
