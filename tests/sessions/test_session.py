"""The /proto session through Channels' communicator: every message of protocol.md and every
bad-input case, with the database checked unchanged after each refusal."""

import json

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob, EvaluationStatus
from tests.factories import BuildFactory, BuildMemberFactory, EvaluationFactory, waiting
from tests.sessions.conftest import CAPS, Session
from workers.models import IdleSlot, JobScore, Worker

pytestmark = pytest.mark.asyncio


def q(fn):
    return sync_to_async(fn)()


def snapshot():
    """Everything a refused frame must leave as it was."""
    return (
        list(DispatchedJob.objects.values_list("id", "finished_at", "outcome").order_by("id")),
        list(IdleSlot.objects.values_list("worker_id", "kind", "recorded_at").order_by("id")),
        list(
            JobScore.objects.values_list("worker_id", "job_id", "missing_nar_size").order_by(
                "worker_id", "job_id"
            )
        ),
        list(DerivationBuild.objects.values_list("id", "status").order_by("id")),
        list(
            Worker.objects.values_list("name", "zone", "draining", "architectures").order_by("id")
        ),
    )


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
    # The first session's assignment went with it, back to the queue.
    row = await q(lambda: DispatchedJob.objects.get(pk=assigned["assignment_id"]))
    assert row.outcome == "Abandoned"
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.QUEUED
    await second.hello()
    await second.send({"type": "RequestJob", "kind": "build"})
    assert (await second.recv_type("AssignJob"))["job_id"] == assigned["job_id"]
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


# Messages


async def test_capabilities_are_recorded_and_acknowledged_with_the_workers_name(worker_session):
    worker, session = await worker_session(name="alpha", zone=None)
    await session.connect()
    ack = await session.hello(zone="eu-1", architectures=["aarch64-linux"])
    assert ack == {"type": "InitAck", "worker": "alpha", "protocol": 1, "heartbeat_secs": 10}
    worker = await q(lambda: Worker.objects.get())
    assert (worker.zone, worker.architectures, worker.endpoint) == (
        "eu-1",
        ["aarch64-linux"],
        "10.0.0.1:7000",
    )
    assert worker.channel_name is not None
    await session.close()


async def test_jobs_the_worker_could_take_are_offered_once_members_included(worker_session):
    _, session = await worker_session()
    single = await q(lambda: BuildFactory(paths=["/nix/store/a"]))
    member = await q(lambda: BuildMemberFactory())
    await q(lambda: waiting(member))
    await q(lambda: BuildFactory(architecture="riscv64-linux"))  # cannot run here
    await session.connect()
    await session.hello()
    offer = await session.recv_type("JobOffer")
    offered = {j["job_id"]: j for j in offer["jobs"]}
    assert set(offered) == {f"build:{single.pk}", member.job_key}
    assert offered[f"build:{single.pk}"]["paths"] == ["/nix/store/a"]
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await session.silent()  # nothing new to offer, nothing to assign
    await session.close()


async def test_scores_steer_the_worker_to_the_job_with_least_to_fetch(worker_session):
    _, session = await worker_session()
    costly, cheap = await q(lambda: BuildFactory.create_batch(2))
    await session.connect()
    await session.hello()
    await session.recv_type("JobOffer")
    scores = [
        {"job_id": f"build:{costly.pk}", "missing_count": 9, "missing_nar_size": 900},
        {"job_id": f"build:{cheap.pk}", "missing_count": 1, "missing_nar_size": 10},
    ]
    await session.send({"type": "JobScores", "scores": scores})
    await session.send({"type": "RequestJob", "kind": "build"})
    assigned = await session.recv_type("AssignJob")
    assert assigned["job_id"] == f"build:{cheap.pk}"
    # A single job's score serves this session's choice alone: kept by the session, no row.
    assert not await q(lambda: JobScore.objects.exists())
    await session.close()


async def test_a_request_with_new_offers_is_answered_by_their_scores(worker_session, settings):
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 5_000}
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    assert await session.silent()  # its first offer: an empty head
    costly, cheap = await q(lambda: BuildFactory.create_batch(2))
    await session.send({"type": "RequestJob", "kind": "build"})
    offer = await session.recv_type("JobOffer")
    assert {j["job_id"] for j in offer["jobs"]} == {costly.job_key, cheap.job_key}
    assert await session.silent()  # the answer waits for the scores
    scores = [
        {"job_id": costly.job_key, "missing_count": 9, "missing_nar_size": 900},
        {"job_id": cheap.job_key, "missing_count": 1, "missing_nar_size": 10},
    ]
    await session.send({"type": "JobScores", "scores": scores})
    assert (await session.recv_type("AssignJob"))["job_id"] == cheap.job_key
    await session.close()


async def test_a_request_whose_offer_goes_unanswered_is_answered_after_the_wait(
    worker_session, settings
):
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 300}
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    assert await session.silent()  # its first offer: an empty head
    build = await q(lambda: BuildFactory())
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.recv_type("JobOffer")
    assert await session.silent(0.15)
    assigned = await session.recv_type("AssignJob", timeout=3)
    assert assigned["job_id"] == build.job_key
    await session.close()


async def test_a_request_is_answered_with_the_best_job_and_a_claimed_row(worker_session):
    worker, session = await worker_session()
    _, prioritized = await q(lambda: BuildFactory.create_batch(2))
    await q(lambda: DerivationBuild.objects.filter(pk=prioritized.pk).update(prioritized=True))
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assigned = await session.recv_type("AssignJob")
    assert assigned["job_id"] == f"build:{prioritized.pk}"
    assert assigned["cluster"] is None
    assert assigned["job"]["steps"] == ["build"] and assigned["job"]["build"] == str(prioritized.pk)
    row = await q(lambda: DispatchedJob.objects.get())
    assert (str(row.pk), row.worker_id, row.finished_at) == (
        assigned["assignment_id"],
        worker.pk,
        None,
    )
    assert await q(lambda: DerivationBuild.objects.get(pk=prioritized.pk).status) == "Building"
    await session.close()


async def test_a_member_of_a_queued_cluster_is_never_assigned_as_a_single_job(worker_session):
    _, session = await worker_session()
    await q(lambda: waiting(BuildMemberFactory()))
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.recv_type("JobOffer")
    assert await session.silent()
    assert not await q(lambda: DispatchedJob.objects.exists())
    assert await q(lambda: list(IdleSlot.objects.values_list("kind", flat=True))) == ["build"]
    await session.close()


async def test_an_empty_answer_records_an_idle_slot_and_an_assignment_clears_it(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await session.silent()
    assert await q(lambda: IdleSlot.objects.filter(kind="build").count()) == 1
    await q(lambda: BuildFactory())
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.recv_type("AssignJob")
    assert not await q(lambda: IdleSlot.objects.exists())
    # Now full (one build slot): another request records no idle slot.
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await session.silent()
    assert not await q(lambda: IdleSlot.objects.exists())
    await session.close()


async def test_draining_clears_idle_slots_and_stops_new_work(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "eval"})
    await session.silent()
    await session.send({"type": "Draining"})
    await session.silent()
    assert not await q(lambda: IdleSlot.objects.exists())
    await q(lambda: EvaluationFactory())
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await session.silent(0.5)
    assert not await q(lambda: DispatchedJob.objects.exists())
    assert not await q(lambda: IdleSlot.objects.exists())
    await session.close()


async def assigned_build(session):
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    return await session.recv_type("AssignJob")


async def test_a_completed_job_finishes_its_row_and_its_build(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {
            "type": "JobCompleted",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "elapsed_ms": 5,
        }
    )
    await session.silent()
    row = await q(lambda: DispatchedJob.objects.get())
    assert row.outcome == "Completed" and row.finished_at is not None
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.COMPLETED
    await session.close()


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("transient", BuildStatus.QUEUED),
        ("timeout", BuildStatus.QUEUED),
        ("permanent", BuildStatus.FAILED_PERMANENT),
        ("aborted", BuildStatus.ABORTED),
    ],
)
async def test_a_failed_build_requeues_or_ends_by_its_failure_kind(worker_session, kind, status):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {
            "type": "JobFailed",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "error": "boom",
            "kind": kind,
        }
    )
    await session.silent()
    assert await q(lambda: DerivationBuild.objects.get().status) == status
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Failed"
    await session.close()


async def test_requeueing_failures_turn_permanent_when_attempts_run_out(worker_session, settings):
    settings.GRADIENT = {**settings.GRADIENT, "MAX_JOB_ATTEMPTS": 2}
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    for _ in range(2):
        await session.send({"type": "RequestJob", "kind": "build"})
        job = await session.recv_type("AssignJob")
        await session.send(
            {
                "type": "JobFailed",
                "job_id": job["job_id"],
                "assignment_id": job["assignment_id"],
                "error": "flaky",
                "kind": "transient",
            }
        )
    await session.silent()
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.FAILED_PERMANENT
    await session.close()


async def test_a_report_for_a_job_the_worker_does_not_hold_is_not_allowed(worker_session):
    _, session = await worker_session()
    _, other = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(other)
    await session.connect()
    await session.hello()
    before = await q(snapshot)
    await session.send(
        {
            "type": "JobCompleted",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "elapsed_ms": 1,
        }
    )
    error = await session.recv_type("Error")
    assert error["code"] == "not_allowed"
    assert await q(snapshot) == before
    await session.close()
    await other.close()


async def test_a_rejected_assignment_goes_back_to_the_queue(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {"type": "AssignJobResponse", "job_id": job["job_id"], "accepted": False, "reason": "no"}
    )
    await session.silent()
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Abandoned"
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.QUEUED
    await session.close()


async def test_a_disconnect_abandons_single_assignments_and_requeues_their_jobs(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await assigned_build(session)
    await session.send({"type": "RequestJob", "kind": "eval"})
    await session.silent()
    await session.close()
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Abandoned"
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.QUEUED
    assert not await q(lambda: IdleSlot.objects.exists())
    assert await q(lambda: Worker.objects.get().channel_name) is None


async def test_a_signal_outside_a_started_attempt_is_not_allowed(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send(
        {
            "type": "ClusterSignal",
            "attempt": "0b6c7c5e-52a1-4b7c-9d43-8a1c3f1c0f11",
            "to": None,
            "payload": {"x": 1},
        }
    )
    assert (await session.recv_type("Error"))["code"] == "not_allowed"
    await session.close()


async def test_a_single_evaluation_splits_for_a_fetch_only_worker(worker_session):
    _, fetcher = await worker_session(name="fetcher")
    _, evaluator = await worker_session(name="evaluator")
    evaluation = await q(lambda: EvaluationFactory())
    await q(lambda: BuildMemberFactory())  # a member build is never split: not an evaluation
    await fetcher.connect()
    await fetcher.hello(eval=False, fetch=True)
    await fetcher.send({"type": "RequestJob", "kind": "eval"})
    fetch = await fetcher.recv_type("AssignJob")
    assert fetch["job"]["steps"] == ["fetch"]
    await fetcher.send(
        {
            "type": "JobCompleted",
            "job_id": fetch["job_id"],
            "assignment_id": fetch["assignment_id"],
            "elapsed_ms": 1,
        }
    )
    await fetcher.silent()
    assert await q(lambda: type(evaluation).objects.get().status) == EvaluationStatus.FETCHING
    await evaluator.connect()
    await evaluator.hello()
    await evaluator.send({"type": "RequestJob", "kind": "eval"})
    follow_up = await evaluator.recv_type("AssignJob")
    assert follow_up["job"]["steps"] == ["evaluate_flake", "evaluate_derivations"]
    await fetcher.close()
    await evaluator.close()


async def test_a_member_evaluation_is_never_split(worker_session):
    from tests.factories import EvalMemberFactory

    _, fetcher = await worker_session()
    await q(lambda: EvalMemberFactory())
    await fetcher.connect()
    await fetcher.hello(eval=False, fetch=True)
    await fetcher.send({"type": "RequestJob", "kind": "eval"})
    assert await fetcher.silent()  # neither offered nor assigned
    assert not await q(lambda: DispatchedJob.objects.exists())
    await fetcher.close()


async def test_workers_cannot_take_jobs_of_projects_they_may_not_access(worker_session):
    _, session = await worker_session(all_projects=False)
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await session.silent()
    assert not await q(lambda: DispatchedJob.objects.exists())
    await session.close()
