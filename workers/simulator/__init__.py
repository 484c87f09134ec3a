"""The reference worker: simulated workers speaking protocol v1 (shared protocol.md) over real
WebSocket connections, many of them on one asyncio loop.

Imports nothing of Django: tests and the e2e harness run it in-process, next to a live server
or a fake one. Every frame is built and parsed with gradient.wire.protocol. By concept: config
(what a worker can do), store (what it has and would fetch), worker (the protocol client of
workers.client, whose run is a timer), fleet (many at once).
"""

from workers.client import HOLD_TIMED_OUT, Job
from workers.simulator.config import Scorer, WorkerConfig
from workers.simulator.fleet import COUNTERS, Fleet
from workers.simulator.store import SIZE_UNIT, has_path, missing_cost, path_nar_size, stable_hash
from workers.simulator.worker import (
    DEFAULT_URL,
    REPLACED_CLOSE_CODE,
    EventLog,
    SimulatedWorker,
    rotated,
    server_urls,
)

__all__ = [
    "COUNTERS",
    "DEFAULT_URL",
    "HOLD_TIMED_OUT",
    "REPLACED_CLOSE_CODE",
    "SIZE_UNIT",
    "EventLog",
    "Fleet",
    "Job",
    "Scorer",
    "SimulatedWorker",
    "WorkerConfig",
    "has_path",
    "missing_cost",
    "path_nar_size",
    "rotated",
    "server_urls",
    "stable_hash",
]
