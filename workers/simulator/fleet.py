"""A fleet: many SimulatedWorkers on one asyncio loop, spread over the servers."""

import asyncio
import time
from collections.abc import Iterable, Sequence

from workers.simulator.config import WorkerConfig
from workers.simulator.worker import (
    DEFAULT_URL,
    EventLog,
    SimulatedWorker,
    rotated,
    server_urls,
)

COUNTERS = ("workers", "connected", "idle", "held", "running", "completed", "failed", "rejected")
COUNTERS += ("stopped",)


class Fleet:
    """Runs many SimulatedWorkers on the current loop, from (name, token, config) triples.
    With several server URLs, worker i starts on URL i (modulo their number) and moves on to
    the next one whenever it reconnects, so the fleet is spread over the servers."""

    def __init__(
        self,
        members: Iterable[tuple[str, str, WorkerConfig]],
        url: str | Sequence[str] = DEFAULT_URL,
        log_path: str | None = None,
        ramp_secs: float = 0.0,  # spread the first connections over this long
    ):
        urls = server_urls(url)
        self.log = EventLog(log_path) if log_path else None
        self.workers = [
            SimulatedWorker(name, token, config, url=rotated(urls, i), log=self.log)
            for i, (name, token, config) in enumerate(members)
        ]
        self.ramp_secs = ramp_secs
        self.started_at = time.monotonic()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Asks run() to stop every worker and return; safe from a signal handler."""
        self._stop.set()

    async def run(self, duration: float | None = None) -> None:
        """Runs until stop(), `duration` seconds, or every worker having stopped for good."""
        self.started_at = time.monotonic()
        tasks = [asyncio.create_task(self._launch(i, w)) for i, w in enumerate(self.workers)]
        all_done = asyncio.gather(*tasks, return_exceptions=True)
        stopped = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait(
                {all_done, stopped}, timeout=duration, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
            await self._shutdown(tasks)
            if self.log is not None:
                self.log.close()

    async def _launch(self, i: int, worker: SimulatedWorker) -> None:
        if self.ramp_secs and self.workers:
            await asyncio.sleep(self.ramp_secs * i / len(self.workers))
        await worker.run()

    async def _shutdown(self, tasks: list[asyncio.Task]) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        _, late = await asyncio.wait(tasks, timeout=5)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started_at

    def counters(self) -> dict[str, int]:
        c = dict.fromkeys(COUNTERS, 0)
        c["workers"] = len(self.workers)
        for w in self.workers:
            c["connected"] += w.connected
            c["idle"] += w.connected and not w.jobs
            c["held"] += len(w.held)
            c["running"] += len(w.running)
            c["completed"] += w.completed
            c["failed"] += w.failed
            c["rejected"] += w.rejected
            c["stopped"] += w.stopped_reason is not None
        return c
