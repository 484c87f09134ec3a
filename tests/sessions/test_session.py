"""The /proto session through Channels' communicator: every message of protocol.md and every
bad-input case, with the database checked unchanged after each refusal. Here: authentication
and bad input; the messages about work to take and the reports on work held have files of
their own (test_session_requests.py, test_session_reports.py)."""

import asyncio
import json

import pytest
from django.utils import timezone

from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from tests.factories import BuildFactory
from tests.sessions.conftest import CAPS, Session
from tests.sessions.session_db import q, snapshot
from workers.models import Worker

pytestmark = pytest.mark.asyncio


# Authentication


async def test_a_missing_unknown_or_revoked_token_is_refused_at_the_handshake(worker_session):
    _, session = await worker_session(revoked_at=timezone.now())
    for token in ["", "no-such-token", session.token]:
        connected, _ = await Session(token).connect()
        assert not connected


async def test_a_second_connection_with_one_token_replaces_the_first(worker_session):
    _, first = await worker_session()
    await q(lambda: BuildFactory())
    assert (await first.connect())[0]
    await first.hello()
    await first.send({"type": "RequestJob", "kind": "build"})
    assigned = await first.recv_type("AssignJob")

    second = Session(first.token)
    assert (await second.connect())[0]
    closed = await first.ws.receive_output(3)
    assert closed == {"type": "websocket.close", "code": 4409}
    # The worker does not say it still runs the first session's assignment: back to the queue.
    await second.hello()
    row = await q(lambda: DispatchedJob.objects.get(pk=assigned["assignment_id"]))
    assert row.outcome == "Abandoned"
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.QUEUED
    await second.send({"type": "RequestJob", "kind": "build"})
    assert (await second.recv_type("AssignJob"))["job_id"] == assigned["job_id"]
    await second.close()


async def test_a_worker_back_after_a_lost_session_keeps_what_it_still_runs(worker_session):
    _, first = await worker_session()
    await q(lambda: BuildFactory.create_batch(2))
    await first.connect()
    await first.hello(max_concurrent_builds=2)
    assigned = []
    for _ in range(2):
        await first.send({"type": "RequestJob", "kind": "build"})
        assigned.append(await first.recv_type("AssignJob"))
    kept, dropped = assigned
    # A server restart: the session is never closed on the server's side.
    second = Session(first.token)
    assert (await second.connect())[0]
    running = [{"job_id": kept["job_id"], "assignment_id": kept["assignment_id"]}]
    await second.hello(max_concurrent_builds=2, running=running)
    rows = await q(lambda: {str(r.pk): r for r in DispatchedJob.objects.all()})
    assert rows[kept["assignment_id"]].finished_at is None
    assert rows[dropped["assignment_id"]].outcome == "Abandoned"
    report = {"type": "JobCompleted", "elapsed_ms": 5, "log_tail": "done"}
    await second.send({**report, **running[0]})
    for _ in range(100):
        row = await q(lambda: DispatchedJob.objects.get(pk=kept["assignment_id"]))
        if row.finished_at is not None:
            break
        await asyncio.sleep(0.05)
    assert (row.outcome, row.log_tail) == ("Completed", "done")
    await second.close()


async def test_a_worker_back_with_a_job_the_server_gave_up_is_told_to_abort_it(worker_session):
    _, first = await worker_session()
    await q(lambda: BuildFactory())
    await first.connect()
    await first.hello()
    await first.send({"type": "RequestJob", "kind": "build"})
    assigned = await first.recv_type("AssignJob")
    await first.close()  # the server saw it go: the assignment is given up at once
    second = Session(first.token)
    assert (await second.connect())[0]
    ids = {"job_id": assigned["job_id"], "assignment_id": assigned["assignment_id"]}
    await second.hello(running=[ids])
    abort = await second.recv_type("AbortJob")
    assert abort["job_id"] == assigned["job_id"]
    await second.close()


async def test_a_revoked_workers_live_socket_closes(worker_session):
    from channels.layers import get_channel_layer

    from gradient.wire.groups import worker_group

    worker, session = await worker_session()
    await session.connect()
    await session.hello()
    await get_channel_layer().group_send(worker_group(worker.pk), {"type": "worker.revoked"})
    assert await session.ws.receive_output(3) == {"type": "websocket.close", "code": 4403}


# Bad input: answered with an Error, state unchanged, the session goes on


BAD_FRAMES = [
    ("not json", "not a JSON object"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"kind": "build"}), "unknown message type None"),
    (json.dumps({"type": "Nope"}), "unknown message type 'Nope'"),
    (json.dumps({"type": "RequestJob"}), "RequestJob: kind: Field required"),
    (json.dumps({"type": "RequestJob", "kind": "deploy"}), "RequestJob: kind"),
    (json.dumps({"type": "JobScores", "scores": [{"job_id": "x"}]}), "JobScores: scores.0"),
    (
        json.dumps({"type": "JobCompleted", "job_id": "eval:1", "assignment_id": "a"}),
        "JobCompleted: job_id",
    ),
    (json.dumps({**CAPS, "max_concurrent_builds": -1}), "max_concurrent_builds"),
    (json.dumps({**CAPS, "eval": "yes"}), "WorkerCapabilities: eval"),
    (json.dumps({"type": "ClusterSignal", "attempt": "x", "payload": 1}), "attempt"),
]


@pytest.mark.parametrize(("frame", "why"), BAD_FRAMES)
async def test_a_malformed_frame_gets_bad_message_and_changes_nothing(worker_session, frame, why):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    await session.recv_type("JobOffer")  # its offered rows are written before it is sent
    before = await q(snapshot)
    await session.send(frame)
    error = await session.recv_type("Error")
    assert error["code"] == "bad_message" and why in error["message"], error
    assert await q(snapshot) == before
    await session.send({"type": "RequestJob", "kind": "build"})
    assert (await session.recv_type("AssignJob"))["job"]["kind"] == "build"
    await session.close()


async def test_the_first_frame_must_be_capabilities(worker_session):
    _, session = await worker_session()
    await session.connect()
    before = await q(snapshot)
    await session.send({"type": "RequestJob", "kind": "build"})
    error = await session.recv()
    assert error == {
        "type": "Error",
        "code": "bad_message",
        "message": "the first frame must be WorkerCapabilities",
    }
    assert await q(snapshot) == before
    await session.hello()
    await session.close()


async def test_a_frame_over_one_mebibyte_closes_the_socket(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send(json.dumps({"type": "Draining", "pad": "x" * (1024 * 1024)}))
    assert await session.ws.receive_output(3) == {"type": "websocket.close", "code": 1009}
    assert not await q(lambda: Worker.objects.get().draining)


async def test_a_flood_of_frames_is_answered_with_rate_limited(worker_session, settings):
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_RATE_PER_SEC": 1, "WORKER_RATE_BURST": 3}
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    for _ in range(3):
        await session.send({"type": "Draining"})
    error = await session.recv()
    assert error["code"] == "rate_limited"
    await session.close()
