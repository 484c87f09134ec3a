"""The /proto session's messages about work to take: capabilities, offers and their scores,
requests and what answers them, idle slots, draining, split evaluations, project access."""

import asyncio

import pytest

from gradient.jobs.models import DerivationBuild, DispatchedJob, EvaluationStatus
from tests.factories import BuildFactory, BuildMemberFactory, EvaluationFactory, waiting
from tests.sessions.session_db import q
from workers.models import IdleSlot, JobScore, Worker

pytestmark = pytest.mark.asyncio


async def idle_slots(expected, timeout=5.0):
    """Wait until the idle slots' kinds are `expected`: the RequestJob that records the last of
    them was answered (with nothing), so whatever it would have sent is sent by now."""

    def kinds():
        return q(lambda: sorted(IdleSlot.objects.values_list("kind", flat=True)))

    for _ in range(int(timeout / 0.05)):
        if await kinds() == expected:
            return True
        await asyncio.sleep(0.05)
    return await kinds() == expected


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
    assert await idle_slots(["eval"])  # answered with nothing
    assert await session.silent(0)  # nothing new to offer, nothing to assign
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
    # The answer waits for the scores: nothing yet, and the job it assigns is the one the
    # scores sent next choose.
    assert await session.silent(0)
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
    loop = asyncio.get_running_loop()
    asked = loop.time()
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.recv_type("JobOffer")
    assigned = await session.recv_type("AssignJob", timeout=3)
    assert loop.time() - asked >= 0.3  # not before the wait for the scores ran out
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
    assert await idle_slots(["build"])
    assert await session.silent(0)
    assert not await q(lambda: DispatchedJob.objects.exists())
    await session.close()


async def test_an_empty_answer_records_an_idle_slot_and_an_assignment_clears_it(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await idle_slots(["build"])
    assert await session.silent(0)
    await q(lambda: BuildFactory())
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.recv_type("AssignJob")
    assert not await q(lambda: IdleSlot.objects.exists())
    # Now full (one build slot): another request records no idle slot. A request for an
    # eval after it (nothing to do: an idle slot) is answered once it was.
    await session.send({"type": "RequestJob", "kind": "build"})
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await idle_slots(["eval"])
    assert await session.silent(0)
    await session.close()


async def test_a_resend_refreshes_its_idle_slot_and_wakes_the_pass_once(
    worker_session, monkeypatch
):
    """A worker asks again every 10 s while a slot stays free: that RequestJob refreshes the
    slot without waking the pass, which has seen it; after a job ran, the slot is new again."""
    woken = []
    monkeypatch.setattr("sessions.request_job.wake_dispatch", lambda: woken.append(1))

    def recorded():
        return q(lambda: IdleSlot.objects.get(kind="build").recorded_at)

    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await idle_slots(["build"])
    assert await session.silent(0)
    first = await recorded()
    await session.send({"type": "RequestJob", "kind": "build"})
    for _ in range(100):
        if await recorded() > first:
            break
        await asyncio.sleep(0.05)
    assert await recorded() > first
    assert await session.silent(0)
    await q(lambda: BuildFactory())
    await session.send({"type": "RequestJob", "kind": "build"})
    assign = await session.recv_type("AssignJob")
    assert len(woken) == 1  # the refresh, handled before this request, woke nothing
    assert not await q(lambda: IdleSlot.objects.exists())
    await session.send(
        {
            "type": "JobCompleted",
            "job_id": assign["job_id"],
            "assignment_id": assign["assignment_id"],
            "elapsed_ms": 5,
        }
    )
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await idle_slots(["build"])
    assert await session.silent(0)
    for _ in range(100):
        if len(woken) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(woken) == 2
    await session.close()


async def test_draining_clears_idle_slots_and_stops_new_work(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await idle_slots(["eval"])
    await session.send({"type": "Draining"})
    assert await idle_slots([])
    await q(lambda: EvaluationFactory())
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await session.silent(0.5)
    assert not await q(lambda: DispatchedJob.objects.exists())
    assert not await q(lambda: IdleSlot.objects.exists())
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
    for _ in range(100):
        if await q(lambda: type(evaluation).objects.get().status) == EvaluationStatus.FETCHING:
            break
        await asyncio.sleep(0.05)
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
    assert await idle_slots(["eval"])  # answered with nothing
    assert await fetcher.silent(0)  # neither offered nor assigned
    assert not await q(lambda: DispatchedJob.objects.exists())
    await fetcher.close()


async def test_workers_cannot_take_jobs_of_projects_they_may_not_access(worker_session):
    _, session = await worker_session(all_projects=False)
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    assert await idle_slots(["build"])  # answered with nothing
    assert await session.silent(0)
    assert not await q(lambda: DispatchedJob.objects.exists())
    await session.close()
