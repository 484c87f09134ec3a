"""Starts first (sessions/starts.py): while many sessions of a process are between their
handshake and their InitAck, the sessions already started hold their work back, their first
offer included, and do it once the starts are done; so does a new session's notice to the one it
replaces."""

import asyncio

import pytest
from asgiref.sync import sync_to_async

from sessions.starts import STORM_STARTS, session_starts
from tests.factories import BuildFactory
from tests.sessions.conftest import Session

pytestmark = pytest.mark.asyncio


class Calm(asyncio.Event):
    """The starts' calm, counting the work that waits for it: held back, not merely slow."""

    def __init__(self):
        super().__init__()
        self.waiting = 0

    async def wait(self):
        self.waiting += 1
        try:
            return await super().wait()
        finally:
            self.waiting -= 1


def storm():
    """As many pending starts on this event loop as a storm has; returns the end of it, and
    the calm that the held-back work waits for."""
    starts = session_starts()
    starts.calm = Calm()
    for _ in range(STORM_STARTS + 1):
        starts.begin()

    def calm():
        for _ in range(STORM_STARTS + 1):
            starts.end()

    return calm, starts.calm


async def held_back(calm: Calm, count: int) -> bool:
    """Whether `count` pieces of work wait for calm within a few seconds."""
    for _ in range(300):
        if calm.waiting == count:
            return True
        await asyncio.sleep(0.01)
    return calm.waiting == count


async def test_a_started_session_offers_nothing_until_the_storm_of_starts_is_over(
    worker_session,
):
    _, session = await worker_session()
    await sync_to_async(BuildFactory)()
    await session.connect()
    calm, waited = storm()
    try:
        await session.hello()  # its own start is not held back
        assert await held_back(waited, 1)
        assert await session.silent(0)  # the first offer waits
    finally:
        calm()
    offer = await session.recv_type("JobOffer")
    assert [job["kind"] for job in offer["jobs"]] == ["build"]
    await session.close()


async def test_a_request_for_work_waits_for_the_storm_of_starts_and_is_answered_after(
    worker_session,
):
    _, session = await worker_session()
    await sync_to_async(BuildFactory)()
    await session.connect()
    await session.hello()
    await session.recv_type("JobOffer")
    calm, waited = storm()
    try:
        await session.send({"type": "RequestJob", "kind": "build"})
        assert await held_back(waited, 1)
        assert await session.silent(0)
    finally:
        calm()
    assert (await session.recv_type("AssignJob"))["job"]["kind"] == "build"
    await session.close()


async def test_the_session_a_new_one_replaces_is_told_once_the_storm_of_starts_is_over(
    worker_session,
):
    _, first = await worker_session()
    await first.connect()
    await first.hello()
    calm, waited = storm()
    try:
        second = Session(first.token)
        assert (await second.connect())[0]
        await second.hello()  # the new session starts at once
        assert await held_back(waited, 2)  # the notice to the old one, and the new one's offer
        assert await first.silent(0)  # the old one is not told yet
    finally:
        calm()
    closed = await first.ws.receive_output(3)
    assert closed == {"type": "websocket.close", "code": 4409}
    await second.close()


async def test_a_start_that_never_sends_its_capabilities_holds_the_others_back_for_a_while_only(
    monkeypatch,
):
    """A start counts among the pending ones for STARTS_FIRST_SECS at most; ended then or at
    its InitAck, it is counted off once."""
    from sessions import starts

    monkeypatch.setattr(starts, "STARTS_FIRST_SECS", 0.2)
    pending = session_starts()
    stuck = [starts.SessionStart() for _ in range(STORM_STARTS + 1)]
    for start in stuck:
        start.begin()
    assert not pending.calm.is_set() and pending.pending == STORM_STARTS + 1
    await asyncio.wait_for(pending.calm.wait(), 5)  # their time ran out
    assert pending.pending == 0
    for start in stuck:
        start.end()  # the InitAck after all, or the disconnect
    assert pending.pending == 0 and pending.calm.is_set()
