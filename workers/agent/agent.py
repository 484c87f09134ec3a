"""The agent: the protocol client (workers.client) whose run is a real process and whose scores
come from this machine's store and binary cache."""

import asyncio
from pathlib import Path

from gradient.wire import protocol as p
from workers.agent import run, scores
from workers.agent.options import Options
from workers.agent.process import JobProcess, end_leftovers, prune
from workers.agent.signals import SignalHub
from workers.client import ClientConfig, Job, Outcome, Worker
from workers.client.events import EventSink

KEPT_RUNS = 20  # finished job directories kept for an operator to read, newest first
# Offers with more paths than this are scored on a thread: the loop keeps serving meanwhile.
PATHS_ON_LOOP = 256


def client_config(options: Options) -> ClientConfig:
    c = options.capabilities
    return ClientConfig(
        architectures=tuple(c.architectures),
        system_features=tuple(c.system_features),
        max_builds=c.max_concurrent_builds,
        max_evals=c.max_concurrent_evals,
        eval=c.eval,
        build=c.build,
        fetch=c.fetch,
        zone=c.zone,
        endpoint=c.endpoint,
        backoff=(0.5, 30.0),
        # A refused token is a mistake an operator must fix; a few tries still ride out a
        # server that answers 403 while it restarts (about 15 s in all).
        forbidden_retries=4,
        forbidden_backoff=1.0,
        ca_file=options.ca_file,
        max_events=200,  # the log keeps them all
    )


class Agent(Worker):
    """One machine's worker. Named by the server's InitAck; `runtime` is a private directory
    of its own for the members' sockets and files."""

    def __init__(self, options: Options, runtime: Path, log: EventSink):
        super().__init__(None, options.token, client_config(options), options.urls, log)
        self.workdir = options.workdir
        self.store, self.cache = options.store, options.cache
        self.kill_grace = options.kill_grace
        self.runtime = runtime
        self.hub = SignalHub(runtime / "signals", self._send_signal, self._record)
        self.processes: dict[str, JobProcess] = {}  # running, by assignment id
        self.abandoned = 0  # jobs still held or running when the session loop ended

    def end_leftovers(self) -> None:
        for line in end_leftovers(self.workdir):
            self._record("leftover_ended", detail=line)

    def prune(self) -> None:
        prune(self.workdir, KEPT_RUNS + self.config.max_builds + self.config.max_evals)

    async def end_processes(self, reason: str) -> None:
        """Aborts what still runs once the session loop has ended (refused, replaced), and
        waits for each to end: no process of a job outlives its agent."""
        processes = list(self.processes.values())
        for process in processes:
            await process.abort(reason)
        await asyncio.gather(*(process.wait() for process in processes))

    def _shut(self) -> None:
        self.abandoned = len(self.jobs)  # their reports will never be made
        super()._shut()

    # The session

    async def _on_init_ack(self, ack: p.InitAck) -> None:
        self.name = ack.worker  # the name its processes are told (GRADIENT_WORKER)
        await super()._on_init_ack(ack)

    async def _scores(self, jobs: list[p.OfferedJob]) -> list[p.Score]:
        if sum(len(job.paths) for job in jobs) > PATHS_ON_LOOP:
            return await asyncio.to_thread(self._score_all, jobs)
        return self._score_all(jobs)

    def _score_all(self, jobs: list[p.OfferedJob]) -> list[p.Score]:
        answers = []
        for job in jobs:
            count, size = scores.missing_cost(job.paths, self.store, self.cache)
            answers.append(p.Score(job_id=job.job_id, missing_count=count, missing_nar_size=size))
        return answers

    async def _on_signal(self, signal: p.ForwardedSignal) -> None:
        await super()._on_signal(signal)
        if any(job.attempt == signal.attempt for job in self.jobs.values()):
            self.hub.deliver(signal.attempt, signal.from_.model_dump(), signal.payload)

    async def _send_signal(self, attempt: str, to: dict | None, payload) -> bool:
        target = None if to is None else (to["role"], to["index"])
        return await self.send_signal(attempt, payload, target)

    # Runs

    async def _execute(self, job: Job) -> Outcome:
        try:
            process = await run.prepare(self, job)
            job.process = process
            if job.abort_error is not None:  # aborted while its files were being made
                await process.abort(job.abort_error)
            await process.start()
            if process.pid is not None:
                self.processes[job.assignment_id] = process
                self._started(job, pid=process.pid, directory=str(process.directory))
            outcome = await process.wait()
            self.processes.pop(job.assignment_id, None)
            return outcome
        finally:
            await run.cleanup(self, job)

    async def _interrupt(self, job: Job) -> None:
        if job.process is not None:
            await job.process.abort(job.abort_error)
