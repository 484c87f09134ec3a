"""The protocol client that both worker programs are (shared protocol.md): the reference
worker (workers.simulator) and the agent (workers.agent). It connects, reconnects with backoff
over several servers, answers offers, holds cluster members until StartCluster and drops them
when their hold expires, refuses what it cannot take, aborts, drains, and keeps the reports made
while disconnected for the next session. What a run is and how a worker scores are its
subclasses' (Worker._execute, Worker._scores).

Imports only the wire format: a worker machine has no database, no Redis and no settings.
By concept: config (what a worker can do, how it reconnects), servers (where it connects),
events (its record of what happened), outbox (reports waiting for a session), connection (the
session), jobs (an assignment and how its run ended), worker (what it does with them).
"""

from workers.client.config import ClientConfig
from workers.client.connection import Connection
from workers.client.events import EventLog
from workers.client.jobs import HOLD_TIMED_OUT, Job, Outcome
from workers.client.servers import DEFAULT_URL, REPLACED_CLOSE_CODE, rotated, server_urls
from workers.client.worker import Worker

__all__ = [
    "DEFAULT_URL",
    "HOLD_TIMED_OUT",
    "REPLACED_CLOSE_CODE",
    "ClientConfig",
    "Connection",
    "EventLog",
    "Job",
    "Outcome",
    "Worker",
    "rotated",
    "server_urls",
]
