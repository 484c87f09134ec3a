"""The agent's life from start to exit status: leftovers of a previous run ended, the session
served, and the stops an operator asks for (protocol.md, "Stopping"): SIGTERM drains, a second
SIGTERM or SIGINT aborts the running jobs. Either way the agent exits once its reports went out,
or, when no server takes them, after a bounded wait."""

import asyncio
import contextlib
import shutil
import signal
import tempfile
from pathlib import Path

from workers.agent.agent import Agent
from workers.agent.log import Log
from workers.agent.options import Options

EXIT_OK, EXIT_UNSENT, EXIT_USAGE, EXIT_REFUSED, EXIT_REPLACED = 0, 1, 2, 3, 4
# Past its jobs' kill grace, how long an interrupted agent waits for a server to take its
# reports before it exits without them.
REPORT_WAIT_SECS = 15.0
INTERRUPTED = "worker interrupted"
STOPPED = "worker stopped"
REFUSALS = {
    "forbidden": "the server kept refusing the token (HTTP 403)",
    "certificate": "the server's certificate did not verify; the token was not sent",
    "replaced": "another agent connected with the same token",
}


class Service:
    def __init__(self, options: Options, log: Log):
        self.options, self.log = options, log
        self.agent: Agent | None = None
        self._stopping: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        self._interrupting = False
        self._terms = 0

    async def run(self) -> int:
        runtime = Path(tempfile.mkdtemp(prefix="gradient-worker-"))
        try:
            self.agent = agent = Agent(self.options, runtime, self.log)
            agent.end_leftovers()
            self._record_start()
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
            loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            try:
                await agent.run()
            finally:  # refused, replaced or broken with jobs still running: they end too
                await agent.end_processes(STOPPED)
                await agent.hub.close_all()
            return self._status()
        finally:
            shutil.rmtree(runtime, ignore_errors=True)

    def _record_start(self) -> None:
        o, c = self.options, self.agent.config
        self.agent._record(
            "starting",
            urls=o.urls,
            builds=c.max_builds,
            evals=c.max_evals,
            arch="+".join(c.architectures),
            features="+".join(c.system_features) or None,
            zone=c.zone,
            endpoint=c.endpoint,
            workdir=str(o.workdir),
            store=str(o.store),
            cache=str(o.cache) if o.cache else None,
        )

    def _status(self) -> int:
        agent = self.agent
        reason = agent.stopped_reason
        lost = agent.unsent + agent.abandoned
        if reason in REFUSALS:
            status = EXIT_REPLACED if reason == "replaced" else EXIT_REFUSED
            agent._record("fatal", reason=REFUSALS[reason], exit=status)
            return status
        if lost:
            agent._record("exiting", unsent_reports=lost, exit=EXIT_UNSENT)
            return EXIT_UNSENT
        agent._record("exiting", exit=EXIT_OK)
        return EXIT_OK

    # Stops

    def _on_sigterm(self) -> None:
        self._terms += 1
        self._stop_by("SIGTERM" if self._terms == 1 else "second SIGTERM", self._terms > 1)

    def _on_sigint(self) -> None:
        self._stop_by("SIGINT", interrupt=True)

    def _stop_by(self, why: str, interrupt: bool) -> None:
        self.agent._record("stop_requested", signal=why)
        if interrupt and self._interrupting:
            return  # under way: nothing left to add
        # A drain under way goes on beside an interrupt: it gave up the held members.
        self._interrupting |= interrupt
        stop = self._interrupt() if interrupt else self._drain()
        self._stopping.add(asyncio.create_task(stop))

    async def _drain(self) -> None:
        agent = self.agent
        await agent.drain()
        await agent.settled()  # no bound: running jobs finish, however long they take
        await agent.stop()

    async def _interrupt(self) -> None:
        agent = self.agent
        await agent.drain()
        await agent.abort_running(INTERRUPTED)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.options.kill_grace + REPORT_WAIT_SECS):
                await agent.settled()
        await agent.stop()
