"""What a session start costs in statements, pinned: in a reconnect storm a thousand of them run
at once, and each statement is a round trip to PostgreSQL plus the ORM's Python on daphne's
one core. A change that adds one fails here; lower the pins when a change removes some."""

import asyncio
import threading
import time

import psycopg
import pytest
from asgiref.sync import sync_to_async

from clusters.wake import WAKE_KEY, _client
from tests.sessions.conftest import Session
from tests.test_query_counts import REQUEST_IDLE_STATEMENTS
from workers.models import Worker

pytestmark = pytest.mark.asyncio

# Up to InitAck and the offer that follows it: authenticate, attach (one statement, also for
# a worker whose earlier session died holding nothing, as when a server is SIGKILLed), the
# capabilities (one statement, the row back for InitAck's name and the offer), and the offer
# (one statement for both kinds, after the setting that keeps its generic plan, in one round
# trip; none queued here, so nothing is written).
START = 5
# Then the reference worker asks for a job per free slot (eval and build) and, none queued,
# gets idle slots: each such RequestJob as pinned where the RequestJob path is (outside a
# test's transaction: no SAVEPOINT), and the dispatch wake-up's question whether any cluster
# waits at all (asked while no pass is queued, as here: with one queued, the wake-up reads
# Redis alone).
REQUESTS = 2 * (REQUEST_IDLE_STATEMENTS + 1)


class Statements:
    """Every statement sent through Django's cursors by any thread: the session's services run
    on executor threads, each with a connection of its own (and kept between tests)."""

    def __init__(self):
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def record(self, sql: str):
        with self._lock:
            self.seen.append(sql)

    def take(self) -> list[str]:
        with self._lock:
            taken, self.seen = self.seen, []
        return taken


@pytest.fixture
def statements(transactional_db, monkeypatch):
    from django.db.backends.utils import CursorWrapper

    counter = Statements()
    execute = CursorWrapper._execute_with_wrappers

    def counted(self, sql, params, many, executor):
        counter.record(sql)
        return execute(self, sql, params, many, executor)

    monkeypatch.setattr(CursorWrapper, "_execute_with_wrappers", counted)
    return counter


def raw_count(sql: str, *params) -> int:
    """Read without Django (so the read is not counted)."""
    from django.db import connection

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as conn:
        return conn.execute(sql, params).fetchone()[0]


async def idle_slots(worker_id: int, wanted: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    sql = "SELECT count(*) FROM idle_slot WHERE worker_id = %s"
    while await sync_to_async(raw_count)(sql, worker_id) < wanted:
        assert time.monotonic() < deadline, "the RequestJobs were not answered"
        await asyncio.sleep(0.01)


async def quiet(statements: "Statements", secs: float = 0.3, timeout: float = 5.0) -> None:
    """Until no statement came for `secs`: a loaded machine may still be finishing a frame."""
    deadline = time.monotonic() + timeout
    seen = -1
    while seen != len(statements.seen):
        assert time.monotonic() < deadline, "the session never went quiet"
        seen = len(statements.seen)
        await asyncio.sleep(secs)


async def start(session: Session, worker_id: int, statements: Statements) -> dict:
    """The reference worker's start: handshake, WorkerCapabilities, InitAck and the offer,
    then a RequestJob per free slot (eval and build), answered with idle slots (no job is
    queued). The handshake is accepted before the session attaches, so attaching counts with
    the capabilities."""
    cost = {}
    assert (await session.connect())[0]
    await session.hello()
    await quiet(statements)  # the offer after InitAck: nothing to offer, nothing sent
    cost["start"] = statements.take()
    await session.send({"type": "RequestJob", "kind": "eval"})
    await session.send({"type": "RequestJob", "kind": "build"})
    await idle_slots(worker_id, 2)
    await quiet(statements)
    cost["requests"] = statements.take()
    return cost


def shown(cost: dict) -> str:
    return "\n".join(f"{phase}: {len(sql)}\n  " + "\n  ".join(sql) for phase, sql in cost.items())


async def test_a_session_start_costs_a_pinned_number_of_statements(worker_session, statements):
    worker, session = await worker_session()
    _client().delete(WAKE_KEY)  # an earlier test's wake-up may still look queued
    statements.take()
    cost = await start(session, worker.pk, statements)
    counts = {phase: len(sql) for phase, sql in cost.items()}
    assert counts == {"start": START, "requests": REQUESTS}, shown(cost)
    await session.close()


async def test_a_start_after_the_server_was_killed_costs_a_pinned_number_too(
    worker_session, statements
):
    worker, session = await worker_session()
    # The row a SIGKILLed daphne leaves: the worker still attached to a channel now dead.
    await sync_to_async(Worker.objects.filter(pk=worker.pk).update)(channel_name="dead!channel")
    statements.take()
    cost = await start(session, worker.pk, statements)
    counts = {phase: len(sql) for phase, sql in cost.items()}
    assert counts == {"start": START, "requests": REQUESTS}, shown(cost)
    await session.close()


async def test_a_start_after_a_kill_forgets_the_dead_sessions_slots_and_offers(worker_session):
    from workers.models import IdleSlot, JobScore

    worker, session = await worker_session()

    def dead_session():
        Worker.objects.filter(pk=worker.pk).update(channel_name="dead!channel")
        IdleSlot.objects.create(worker_id=worker.pk, kind="build", recorded_at="2026-01-01T00:00Z")
        JobScore.objects.create(
            worker_id=worker.pk, job_id="build:1", offered_at="2026-01-01T00:00Z"
        )

    await sync_to_async(dead_session)()
    assert (await session.connect())[0]
    await session.hello()
    assert not await sync_to_async(IdleSlot.objects.exists)()
    assert not await sync_to_async(JobScore.objects.exists)()
    row = await sync_to_async(Worker.objects.get)(pk=worker.pk)
    assert row.channel_name not in (None, "dead!channel")
    await session.close()
