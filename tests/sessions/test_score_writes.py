"""The members' scores of many sessions, written together (sessions.score_writes): answers that
come while a write is under way wait for the next one, on one frame thread instead of a thread
each, and a write that fails ends only the session whose answer failed."""

import asyncio

import pytest

from sessions.threads import FRAME_THREADS
from tests.factories import BuildMemberFactory, waiting
from tests.sessions.session_db import TableLock, eventually, q
from workers.models import JobScore, Worker

pytestmark = pytest.mark.asyncio

KEY = "build:00000000-0000-0000-0000-{:012d}"


def scores(worker: int, size: int = 7) -> dict:
    return {
        "type": "JobScores",
        "scores": [{"job_id": KEY.format(worker), "missing_count": 1, "missing_nar_size": size}],
    }


def scored() -> dict[str, int]:
    rows = JobScore.objects.filter(missing_nar_size__isnull=False)
    return dict(rows.values_list("job_id", "missing_nar_size"))


async def connected(worker_session, count: int) -> list:
    """Sessions whose first offer (a waiting member's) is made: nothing of theirs is under way."""
    await q(lambda: waiting(BuildMemberFactory()))
    sessions = []
    for _ in range(count):
        _, session = await worker_session()
        await session.connect()
        await session.hello()
        await session.recv_type("JobOffer")
        sessions.append(session)
    return sessions


async def test_answers_that_come_during_a_write_share_the_next_one(worker_session):
    sessions = await connected(worker_session, FRAME_THREADS + 2)
    lock = await q(lambda: TableLock("job_score"))
    try:
        await sessions[0].send(scores(0))
        assert await eventually(lambda: lock.waiters() == 1)
        for i, session in enumerate(sessions[1:], start=1):
            await session.send(scores(i))
        await asyncio.sleep(0.5)
        # Answered one at a time, each would wait on a frame thread of its own.
        assert await q(lock.waiters) == 1
    finally:
        await q(lock.release)
    expected = {KEY.format(i): 7 for i in range(len(sessions))}
    assert await eventually(lambda: scored() == expected)
    for session in sessions:
        assert await session.silent()  # every session stays open


async def test_a_write_that_fails_ends_only_the_session_whose_answer_failed(worker_session):
    sessions = await connected(worker_session, 3)
    # w1's row deleted under its open session: its score cannot be written, and the write
    # it shares with w2's fails.
    await q(lambda: Worker.objects.filter(name="w1").delete())
    lock = await q(lambda: TableLock("job_score"))
    try:
        await sessions[0].send(scores(0))
        assert await eventually(lambda: lock.waiters() == 1)
        await sessions[1].send(scores(1))
        await sessions[2].send(scores(2))
        await asyncio.sleep(0.3)
    finally:
        await q(lock.release)
    assert await eventually(lambda: KEY.format(2) in scored())
    assert KEY.format(1) not in await q(scored)
    closed = await sessions[1].ws.receive_output(3)
    assert closed["type"] == "websocket.close"
    assert await sessions[0].silent()
    assert await sessions[2].silent()
