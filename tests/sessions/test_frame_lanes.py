"""A session's queues of frames: reports are never held back by the bulk (offers, scores,
requests for work), nor a member's acceptance by the reports, and no frame overtakes an earlier
one it may depend on; a resent RequestJob does not pile up, and nothing is handled after the
disconnect."""

import asyncio
import threading
import uuid

import psycopg
import pytest
from django.db import connection

from gradient.jobs.models import DispatchedJob
from gradient.wire.protocol import AssignJobResponse, JobCompleted, JobScores, RequestJob
from sessions.frame_queue import FrameQueue, Touch
from sessions.lanes import Lanes
from sessions.requests import Requests
from tests.factories import BuildFactory, EvaluationFactory
from tests.sessions.session_db import q

pytestmark = pytest.mark.asyncio


class TableLock:
    """An ACCESS EXCLUSIVE lock on a table, held by a connection of its own until released:
    every statement that reads the table waits for it."""

    def __init__(self, table: str):
        params = connection.get_connection_params()
        self.conn = psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"})
        self.conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        self.table = table

    def waiters(self) -> int:
        with psycopg.connect(self.conn.info.dsn, password=self.conn.info.password) as c:
            return c.execute(
                "SELECT count(*) FROM pg_locks WHERE relation = %s::regclass AND NOT granted",
                [self.table],
            ).fetchone()[0]

    def release(self):
        self.conn.rollback()
        self.conn.close()


async def eventually(check, timeout=5.0):
    """Whether a database check holds within the timeout (polled off the event loop)."""
    for _ in range(int(timeout / 0.05)):
        if await q(check):
            return True
        await asyncio.sleep(0.05)
    return await q(check)


async def until(check, timeout=5.0):
    """Whether a check of the event loop's own state holds within the timeout."""
    for _ in range(int(timeout / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


async def test_a_report_is_handled_while_a_request_before_it_waits_for_the_database(
    worker_session,
):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    job = await session.recv_type("AssignJob")
    await q(lambda: EvaluationFactory())
    lock = await q(lambda: TableLock("job_score"))  # the next offer reads job_score
    try:
        await session.send({"type": "RequestJob", "kind": "eval"})
        assert await eventually(lambda: lock.waiters() == 1)  # the offer waits for the lock
        await session.send(
            {
                "type": "JobCompleted",
                "job_id": job["job_id"],
                "assignment_id": job["assignment_id"],
                "elapsed_ms": 5,
            }
        )
        # Recorded while the RequestJob before it still waits.
        assert await eventually(
            lambda: DispatchedJob.objects.get(job_id=job["job_id"]).outcome == "Completed"
        )
        assert await q(lock.waiters) == 1
    finally:
        await q(lock.release)
    offer = await session.recv_type("JobOffer")  # then the request is answered as before
    assert [j["kind"] for j in offer["jobs"]] == ["eval"]
    await session.close()


async def test_the_bulk_waits_for_the_reports_that_came_before_it():
    handled = []
    report_started, report_gate = asyncio.Event(), asyncio.Event()

    async def handle_report(frame):
        report_started.set()
        await report_gate.wait()
        handled.append(frame)

    async def handle_bulk(frame):
        handled.append(frame)

    async def failed(frame):
        raise AssertionError(frame)

    reports = FrameQueue("reports", handle_report, failed)
    bulk = FrameQueue("bulk", handle_bulk, failed)
    done = reports.put("completed")
    bulk.put("request", after=done)
    scores = bulk.put("scores")
    await asyncio.wait_for(report_started.wait(), 5)
    # The bulk took the request (only the scores still queued) and handles nothing: the
    # request waits for the report under way, the scores for the request.
    assert await until(lambda: bulk.waiting(lambda frame: True) == 1)
    assert handled == []
    report_gate.set()
    await asyncio.wait_for(scores, 5)
    assert handled == ["completed", "request", "scores"]
    await reports.stop()
    await bulk.stop()


async def test_stop_lets_the_frame_under_way_end_and_drops_the_rest():
    started, release = asyncio.Event(), asyncio.Event()
    handled = []

    async def handle(frame):
        started.set()
        await release.wait()
        handled.append(frame)

    async def failed(frame):
        raise AssertionError(frame)

    queue = FrameQueue("bulk", handle, failed)
    first, *rest = [queue.put(frame) for frame in ("first", "second", "third")]
    await asyncio.wait_for(started.wait(), 5)
    stopping = asyncio.create_task(queue.stop())
    # The frames not yet under way are settled by stop() as it drops them, before it waits.
    await asyncio.wait_for(asyncio.gather(*rest), 5)
    assert not first.done() and not stopping.done()  # waits for the frame under way
    release.set()
    await asyncio.wait_for(stopping, 5)
    assert first.done() and handled == ["first"]
    assert queue.put("late").done()  # nothing is queued once stopped
    assert queue.waiting(lambda frame: True) == 0 and handled == ["first"]


async def test_a_failing_frame_ends_the_queue_and_reports_it():
    failures = []

    async def handle(frame):
        if frame == "bad":
            raise RuntimeError("database gone")

    async def failed(frame):
        failures.append(frame)

    queue = FrameQueue("bulk", handle, failed)
    queue.put("bad")
    after = queue.put("next")
    await asyncio.wait_for(after, 1)  # settled, though never handled
    assert failures == ["bad"]
    await queue.stop()


def lanes_of(handle, slots=None, singles=()) -> tuple[Lanes, Requests]:
    """A session's lanes, with its Requests knowing the worker's slots and the single jobs it
    gave out."""

    async def failed(frame):
        raise AssertionError(frame)

    requests = Requests(1, reply=None, queue=None)
    requests.slots = slots or {"eval": 1, "build": 1}
    requests.singles.update(singles)
    return Lanes("w", handle, failed, requests), requests


async def test_a_resent_request_beyond_the_slots_of_its_kind_is_not_queued():
    started, blocked = asyncio.Event(), threading.Event()

    async def handle(frame):
        started.set()
        await asyncio.to_thread(blocked.wait, 5)

    lanes, _ = lanes_of(handle, slots={"eval": 1, "build": 2})
    lanes.put(RequestJob(kind="eval"))
    await asyncio.wait_for(started.wait(), 5)  # under way
    for kind in ("eval", "eval", "eval", "build", "build", "build"):
        lanes.put(RequestJob(kind=kind))
    lanes.put(JobScores(scores=[]))
    assert lanes.bulk.waiting(lambda m: isinstance(m, RequestJob) and m.kind == "eval") == 1
    assert lanes.bulk.waiting(lambda m: isinstance(m, RequestJob) and m.kind == "build") == 2
    assert lanes.bulk.waiting(lambda m: isinstance(m, JobScores)) == 1
    blocked.set()
    await lanes.stop()


async def test_a_members_answer_overtakes_reports_and_a_single_jobs_answer_queues_behind_them():
    """Frames routed by kind: the answer to a job this session gave out is a report, the
    answer to a member an acceptance, which overtakes the reports before it; the session's
    touch waits for no report, a request for work does."""
    completed, single, member = (f"build:{uuid.uuid4()}" for _ in range(3))
    gate = asyncio.Event()
    handled = []

    async def handle(frame):
        if isinstance(frame, JobCompleted):
            await gate.wait()
        handled.append(frame)

    lanes, _ = lanes_of(handle, singles={single})
    done = JobCompleted(job_id=completed, assignment_id=str(uuid.uuid4()), elapsed_ms=5)
    answers = [AssignJobResponse(job_id=job, accepted=True) for job in (single, member)]
    touch, request = Touch(liveness=False), RequestJob(kind="build")
    for frame in (done, *answers, touch, request):
        lanes.put(frame)
    assert await until(lambda: len(handled) == 2)
    assert {id(frame) for frame in handled} == {id(answers[1]), id(touch)}
    assert lanes.reports.waiting(lambda frame: True) == 1  # the single's answer, behind
    gate.set()
    assert await until(lambda: len(handled) == 5)
    assert handled[2:] == [done, answers[0], request]
    await lanes.stop()


class RowLocks:
    """Row locks on some assignments, held by a connection of its own until released: a
    report that finishes one of those rows waits for it."""

    def __init__(self, job_ids: list[str]):
        params = connection.get_connection_params()
        self.conn = psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"})
        self.conn.execute(
            "SELECT 1 FROM dispatched_job WHERE job_id = ANY(%s) FOR UPDATE", [job_ids]
        )

    def waiters(self) -> int:
        with psycopg.connect(self.conn.info.dsn, password=self.conn.info.password) as c:
            return c.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()[0]

    def release(self):
        self.conn.rollback()
        self.conn.close()


async def idle_with_a_single_under_way(worker_session):
    """A worker with two build slots: one runs a single build, the other is idle. Returns the
    session and the single's AssignJob."""
    from workers.models import IdleSlot

    worker, session = await worker_session()
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello(max_concurrent_builds=2)
    await session.send({"type": "RequestJob", "kind": "build"})
    single = await session.recv_type("AssignJob")
    assert single["cluster"] is None
    await session.send({"type": "RequestJob", "kind": "build"})  # nothing left: an idle slot
    assert await eventually(lambda: IdleSlot.objects.filter(worker=worker).exists())
    return session, single


async def place_a_member(session):
    """A cluster of one build member, placed by a pass on the session's idle slot: its held
    AssignJob."""
    from clusters.dispatch import run_pass
    from gradient.wire.groups import drain_sends
    from tests.factories import BuildMemberFactory, ClusterFactory

    def submit():
        BuildMemberFactory(cluster_job=ClusterFactory(), role="only")
        claimed = run_pass().claimed
        drain_sends()  # the pass's AssignJob is in the session's channel when this returns
        return claimed

    assert len(await q(submit)) == 1
    held = await session.recv_type("AssignJob")
    assert held["cluster"] is not None
    return held


def accept(held) -> dict:
    return {"type": "AssignJobResponse", "job_id": held["job_id"], "accepted": True}


async def test_a_members_acceptance_starts_its_attempt_while_every_report_thread_waits(
    worker_session, settings
):
    """A member's AssignJobResponse has threads of its own: its attempt's seats are held until
    it is read, so it must not queue behind other workers' reports (each settling its job)."""
    from sessions.threads import REPORT_THREADS
    from workers.models import IdleSlot

    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 0}  # placed without asking
    reporters = [(await worker_session())[1] for _ in range(REPORT_THREADS)]
    member_worker, member = await worker_session()
    jobs = []
    for session in reporters:
        await q(lambda: BuildFactory())
        await session.connect()
        await session.hello()
        await session.send({"type": "RequestJob", "kind": "build"})
        jobs.append(await session.recv_type("AssignJob"))
    await member.connect()
    await member.hello()
    await member.send({"type": "RequestJob", "kind": "build"})  # nothing left: an idle slot
    assert await eventually(lambda: IdleSlot.objects.filter(worker=member_worker).exists())
    held = await place_a_member(member)
    locks = await q(lambda: RowLocks([job["job_id"] for job in jobs]))
    try:
        for session, job in zip(reporters, jobs, strict=True):
            done = {"job_id": job["job_id"], "assignment_id": job["assignment_id"]}
            await session.send({"type": "JobCompleted", **done, "elapsed_ms": 5})
        assert await eventually(lambda: locks.waiters() == REPORT_THREADS)
        await member.send(accept(held))
        start = await member.recv_type("StartCluster")
        assert start["attempt"] == held["cluster"]["attempt"]
        assert await q(locks.waiters) == REPORT_THREADS  # the reports still wait
    finally:
        await q(locks.release)
    for job in jobs:
        assert await eventually(
            lambda job=job: DispatchedJob.objects.get(job_id=job["job_id"]).outcome == "Completed"
        )
    for session in [*reporters, member]:
        await session.close()


async def test_a_members_acceptance_does_not_wait_for_its_own_workers_earlier_report(
    worker_session, settings
):
    """A worker completes a single job just before it accepts a member on its other slot: the
    completion waits for its row, and the acceptance still starts the attempt."""
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 0}  # placed without asking
    session, single = await idle_with_a_single_under_way(worker_session)
    await session.send({"type": "AssignJobResponse", "job_id": single["job_id"], "accepted": True})
    held = await place_a_member(session)
    locks = await q(lambda: RowLocks([single["job_id"]]))
    try:
        done = {"job_id": single["job_id"], "assignment_id": single["assignment_id"]}
        await session.send({"type": "JobCompleted", **done, "elapsed_ms": 5})
        assert await eventually(lambda: locks.waiters() == 1)
        await session.send(accept(held))
        start = await session.recv_type("StartCluster")
        assert start["attempt"] == held["cluster"]["attempt"]
        assert await q(locks.waiters) == 1  # the completion still waits
    finally:
        await q(locks.release)
    assert await eventually(
        lambda: DispatchedJob.objects.get(job_id=single["job_id"]).outcome == "Completed"
    )
    await session.close()


async def test_a_report_after_a_members_acceptance_waits_for_it(worker_session, settings):
    """The reports keep their order with the acceptances before them: a completion sent
    after a member's acceptance is recorded only once the acceptance is."""
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 0}  # placed without asking
    session, single = await idle_with_a_single_under_way(worker_session)
    held = await place_a_member(session)
    locks = await q(lambda: RowLocks([held["job_id"]]))  # the acceptance reads its seat
    try:
        await session.send(accept(held))
        assert await eventually(lambda: locks.waiters() == 1)
        done = {"job_id": single["job_id"], "assignment_id": single["assignment_id"]}
        await session.send({"type": "JobCompleted", **done, "elapsed_ms": 5})
        # Answered on arrival, so the completion before it is queued by now.
        await session.send({"type": "NoSuchFrame"})
        assert (await session.recv_type("Error"))["code"] == "bad_message"
        assert await q(lambda: DispatchedJob.objects.get(job_id=single["job_id"]).outcome) is None
    finally:
        await q(locks.release)
    await session.recv_type("StartCluster")
    assert await eventually(
        lambda: DispatchedJob.objects.get(job_id=single["job_id"]).outcome == "Completed"
    )
    # Recorded after the acceptance, which waited for the lock.
    accepted, finished = await q(
        lambda: (
            DispatchedJob.objects.get(job_id=held["job_id"]).accepted_at,
            DispatchedJob.objects.get(job_id=single["job_id"]).finished_at,
        )
    )
    assert accepted < finished
    await session.close()
