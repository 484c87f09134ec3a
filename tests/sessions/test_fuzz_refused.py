"""Fuzzing the worker protocol through the session, on the real database: every refused
frame (malformed, or about jobs, assignments and attempts the session does not hold) is
answered with Error bad_message or not_allowed, the socket stays open and the database is
exactly as it was.
"""

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from django.apps import apps
from hypothesis import event, given
from hypothesis import strategies as st

from gradient.wire.keys import JOB_KEY_PATTERN
from gradient.wire.protocol import INBOUND
from tests.sessions.bad_frames import damaged_text, encoded, mutated, rejected, shaped_frames
from tests.sessions.fuzz_harness import SESSION, OnLoop, q, send_raw
from tests.sessions.schema_strategies import objects, valid_frames

SNAPSHOT_APPS = ("jobs", "workers", "clusters")
VOLATILE = {"last_seen_at"}  # liveness: any frame may refresh it


def snapshot():
    """Every row of the scheduler's tables, but liveness."""
    state = {}
    for label in SNAPSHOT_APPS:
        for model in apps.get_app_config(label).get_models():
            rows = model.objects.order_by("pk").values()
            state[model._meta.label] = [
                {k: v for k, v in row.items() if k not in VOLATILE} for row in rows
            ]
    return state


@dataclass
class World:
    """A capabilities-acked session holding one build and an idle eval slot, a session that
    never sent WorkerCapabilities, a queued build, a single build held by another worker, and
    a started cluster attempt of two other workers."""

    fuzzer: Any
    newcomer: Any
    held: tuple[str, str]
    queued: str
    others: list[tuple[str, str]]
    attempt: str

    @property
    def job_ids(self):
        return [self.held[0], self.queued, *(j for j, _ in self.others)]

    @property
    def assignment_ids(self):
        return [self.held[1], *(a for _, a in self.others)]

    def allowed(self, frame) -> bool:
        """Would the fuzzer's session act on this well-formed frame?"""
        same_job = frame.get("job_id", "").lower() == self.held[0].lower()
        if frame["type"] == "AssignJobResponse":
            return same_job
        if frame["type"] in ("JobCompleted", "JobFailed"):
            return same_job and uuid.UUID(frame["assignment_id"]) == uuid.UUID(self.held[1])
        return False


def other_workers_state():
    from clusters import coordinator
    from clusters.dispatch import run_pass
    from clusters.models import ClusterAttempt
    from gradient.jobs.models import DispatchedJob
    from tests.clusterflow import idle_workers
    from tests.factories import (
        BuildFactory,
        BuildMemberFactory,
        ClusterFactory,
        EvalMemberFactory,
        WorkerFactory,
    )
    from workers import assignment

    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    idle_workers(2)
    assert run_pass().claimed == [cluster.pk]
    members = list(DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster))
    for row in members:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert attempt.started_at is not None and attempt.finished_at is None
    other = WorkerFactory(name="other")
    BuildFactory()
    single = assignment.request_job(other.pk, "build").assign
    assert single is not None
    others = [
        (single.job_id, single.message.assignment_id),
        *((r.job_id, str(r.pk)) for r in members),
    ]
    return others, str(attempt.pk)


async def build_world(make) -> World:
    from tests.factories import BuildFactory
    from workers.assignment import record_idle

    others, attempt = await q(other_workers_state)
    fuzzer_worker, fuzzer = await make(name="fuzzer")
    _, newcomer = await make(name="newcomer")
    await q(lambda: BuildFactory.create_batch(2))
    assert (await fuzzer.connect())[0]
    await fuzzer.hello()
    offer = await fuzzer.recv_type("JobOffer")
    await fuzzer.send({"type": "RequestJob", "kind": "build"})
    held = await fuzzer.recv_type("AssignJob")
    (queued,) = [j["job_id"] for j in offer["jobs"] if j["job_id"] != held["job_id"]]
    # Scored offers stay across a repeated WorkerCapabilities, so re-sending it changes nothing.
    scores = [
        {"job_id": j["job_id"], "missing_count": 1, "missing_nar_size": 2} for j in offer["jobs"]
    ]
    await fuzzer.send({"type": "JobScores", "scores": scores})
    await q(lambda: record_idle(fuzzer_worker.pk, "eval"))
    await fuzzer.hello()  # frames are handled in order: the scores are stored now
    assert (await newcomer.connect())[0]
    return World(fuzzer, newcomer, (held["job_id"], held["assignment_id"]), queued, others, attempt)


@dataclass
class Step:
    to: str  # "fuzzer" or "newcomer"
    raw: str | bytes
    code: str


def malformed(to: str) -> st.SearchStrategy:
    frames = st.one_of(
        st.tuples(mutated(), st.sampled_from(["ascii", "utf8", "bytes"])).map(
            lambda c: encoded(c[0].frame, c[1])
        ),
        shaped_frames().map(json.dumps),
        damaged_text(),
        st.binary(max_size=200),
        st.text(max_size=200),
    )
    # The communicator cannot send an empty frame.
    return frames.filter(lambda raw: raw and rejected(raw)).map(
        lambda raw: Step(to, raw, "bad_message")
    )


def not_allowed_frames(world: World) -> st.SearchStrategy:
    """Well formed, but about jobs, assignments and attempts the fuzzer does not hold."""
    job_keys = st.from_regex(JOB_KEY_PATTERN, fullmatch=True)
    uuids = st.uuids().map(str)

    def cased(ids):
        return st.sampled_from(ids).flatmap(lambda i: st.sampled_from([i, i.upper()]))

    @st.composite
    def frames(draw):
        name = draw(
            st.sampled_from(["JobCompleted", "JobFailed", "AssignJobResponse", "ClusterSignal"])
        )
        body = draw(objects(INBOUND[name]))
        if "job_id" in body:
            job = draw(st.sampled_from(world.job_ids) | job_keys)
            body["job_id"] = draw(st.sampled_from([job, job.replace(job[-36:], job[-36:].upper())]))
        if "assignment_id" in body:
            body["assignment_id"] = draw(cased(world.assignment_ids) | uuids)
        if name == "ClusterSignal":
            body["attempt"] = draw(cased([world.attempt]) | uuids)
            if body.get("to") is not None and draw(st.booleans()):
                body["to"]["role"] = draw(st.sampled_from(["server", "client"]))
        return {"type": name, **body}

    return frames().filter(lambda f: not world.allowed(f)).map(json.dumps)


def refused_steps(world: World) -> st.SearchStrategy:
    not_capabilities = tuple(n for n in sorted(INBOUND) if n != "WorkerCapabilities")
    not_allowed = not_allowed_frames(world).map(lambda raw: Step("fuzzer", raw, "not_allowed"))
    return st.one_of(
        malformed("fuzzer"),
        not_allowed,
        malformed("fuzzer"),
        not_allowed,
        # Before WorkerCapabilities, anything else is bad_message, valid or not.
        malformed("newcomer"),
        valid_frames(not_capabilities).map(
            lambda c: Step("newcomer", json.dumps({"type": c[0], **c[1]}), "bad_message")
        ),
        not_allowed_frames(world).map(lambda raw: Step("newcomer", raw, "bad_message")),
    )


@pytest.mark.asyncio
async def test_refused_frames_are_answered_keep_the_session_and_change_nothing(
    worker_session, settings
):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "WORKER_RATE_PER_SEC": 100_000,
        "WORKER_RATE_BURST": 100_000,
    }
    world = await build_world(worker_session)
    on_loop = OnLoop()

    async def refuse_all(steps):
        before = await q(snapshot)
        for step in steps:
            session = getattr(world, step.to)
            await send_raw(session, step.raw)
            reply = await session.recv()
            assert reply["type"] == "Error", reply
            assert reply["code"] == step.code and reply["message"], reply
            assert await q(snapshot) == before
        # Still open and still the same session: a repeated WorkerCapabilities is re-acked
        # and, the offers being scored already, changes nothing either.
        await world.fuzzer.hello()
        assert await q(snapshot) == before

    @SESSION
    @given(st.data())
    def refused(data):
        steps = data.draw(st.lists(refused_steps(world), min_size=1, max_size=8), "steps")
        for step in steps:
            event(f"{step.to}: {step.code}: {type(step.raw).__name__}")
        on_loop(refuse_all(steps))

    await asyncio.to_thread(refused)
    assert await world.fuzzer.silent(0.1) and await world.newcomer.silent(0.1)
    await world.newcomer.hello()  # the newcomer was never ready, and still can be
    await world.fuzzer.close()
    await world.newcomer.close()


@pytest.mark.asyncio
async def test_random_bytes_frames_get_bad_message(worker_session, settings):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "WORKER_RATE_PER_SEC": 100_000,
        "WORKER_RATE_BURST": 100_000,
    }
    _, session = await worker_session()
    assert (await session.connect())[0]
    await session.hello()
    on_loop = OnLoop()

    async def refuse_all(frames):
        before = await q(snapshot)
        for raw in frames:
            await session.ws.send_to(bytes_data=raw)
            reply = await session.recv()
            assert (reply["type"], reply["code"]) == ("Error", "bad_message"), reply
        assert await q(snapshot) == before
        await session.hello()

    @SESSION
    @given(st.lists(st.binary(min_size=1, max_size=512).filter(rejected), min_size=1, max_size=8))
    def refused(frames):
        on_loop(refuse_all(frames))

    await asyncio.to_thread(refused)
    await session.close()
