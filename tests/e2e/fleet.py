"""Reference workers for end-to-end tests: created in the test database, run in the test's
event loop against a real daphne."""

import asyncio
import contextlib
from collections import Counter
from dataclasses import replace

from asgiref.sync import sync_to_async
from django.db import connection

from tests.factories import WorkerFactory
from workers.models import hash_token
from workers.simulator import SimulatedWorker, WorkerConfig

QUICK = WorkerConfig(heartbeat_secs=0.5, job_secs=(0.3, 0.5), backoff=(0.05, 0.5))


def q(fn):
    def run():
        try:
            return fn()
        finally:
            connection.close()  # no connection left behind to block the test database's drop

    return sync_to_async(run)()


async def until(check, timeout=30.0, every=0.1):
    """Poll `check` (run against the database) until it is truthy; its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await q(check)
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached within {timeout}s: {check}")
        await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def fleet(url, specs: dict[str, dict]):
    """Run one simulated worker per name; specs give WorkerConfig overrides."""
    workers = {}
    for name, overrides in specs.items():
        await q(lambda n=name: WorkerFactory(name=n, token_hash=hash_token(f"t-{n}")))
        workers[name] = SimulatedWorker(name, f"t-{name}", replace(QUICK, **overrides), url)
    tasks = [asyncio.create_task(w.run()) for w in workers.values()]
    try:
        yield workers
    finally:
        for w in workers.values():
            await w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


def members_held_twice(workers) -> list:
    """(worker, attempt) pairs where one worker accepted two members of one attempt."""
    held = Counter(
        (name, e.get("attempt"))
        for name, w in workers.items()
        for e in w.events
        if e["event"] in ("accepted", "held")
        and e.get("attempt")
        and not e.get("silent")
        and e["event"] == "accepted"
    )
    return [pair for pair, n in held.items() if n > 1]
