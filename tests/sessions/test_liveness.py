import asyncio
from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from gradient.jobs.transitions import advance_build
from sessions.liveness import disconnect_silent_workers
from tests.clusterflow import claim_assignment, committed
from tests.factories import BuildFactory, WorkerFactory
from tests.sessions.session_db import q
from workers import liveness
from workers.models import IdleSlot, Worker


@pytest.mark.django_db
def test_a_silent_worker_is_disconnected_and_its_single_jobs_requeued(settings, memory_layer):
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    now = timezone.now()
    # last_seen_at lags a live session's last frame by up to a touch period (30 s here).
    silent = WorkerFactory(channel_name="gone", last_seen_at=now - timedelta(seconds=151))
    alive = WorkerFactory(channel_name="here", last_seen_at=now - timedelta(seconds=149))
    build = BuildFactory()
    assert claim_assignment(
        Assignment(ClaimGate("build", build.pk), silent.pk, build.project_id, ["build"])
    )
    assert advance_build(build.pk, BuildStatus.BUILDING)
    IdleSlot.objects.create(worker=silent, kind="eval", recorded_at=now)

    assert disconnect_silent_workers(now) == [silent.pk]
    assert Worker.objects.get(pk=silent.pk).channel_name is None
    assert Worker.objects.get(pk=alive.pk).channel_name == "here"
    assert DispatchedJob.objects.get().outcome == "Abandoned"
    assert DerivationBuild.objects.get().status == BuildStatus.QUEUED
    assert not IdleSlot.objects.exists()
    assert disconnect_silent_workers(now) == []


@committed
def test_a_silent_workers_cluster_member_is_never_requeued_as_a_single_job(settings, memory_layer):
    """Members count as tracked while their attempt is open: the sweep does not abandon them
    as single jobs; their loss goes into the attempt's verdict instead."""
    from clusters import coordinator
    from clusters.dispatch import run_pass
    from clusters.models import ClusterAttempt
    from tests.clusterflow import idle_workers
    from tests.factories import BuildMemberFactory, ClusterFactory

    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    cluster = ClusterFactory(retry_budget=1)
    BuildMemberFactory(cluster_job=cluster, role="a")
    BuildMemberFactory(cluster_job=cluster, role="b")
    idle_workers(2)
    run_pass()
    rows = list(DispatchedJob.objects.all())
    for row in rows:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    silent = rows[0].worker
    Worker.objects.filter(pk=silent.pk).update(last_seen_at=timezone.now() - timedelta(600))

    assert disconnect_silent_workers() == [silent.pk]
    attempt = ClusterAttempt.objects.get()
    assert attempt.outcome == "Failed"  # decided by the verdict: a lost member, a retry
    cluster.refresh_from_db()
    assert cluster.status == "Queued"
    # Both builds went back through the verdict (Retry), not as single jobs.
    assert set(DerivationBuild.objects.values_list("status", flat=True)) == {BuildStatus.QUEUED}
    assert DispatchedJob.objects.get(pk=rows[0].pk).outcome == "Failed"


@pytest.mark.parametrize(
    ("timeout", "period"), [(120, 30.0), (600, 30.0), (10, 2.5), (2, 0.5)], ids=str
)
def test_a_touch_period_is_a_quarter_of_the_timeout_at_most_30_s(settings, timeout, period):
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": timeout}
    assert liveness.touch_every() == period
    now = timezone.now()
    assert liveness.silent_before(now) == now - timedelta(seconds=timeout + period)


@pytest.mark.asyncio
async def test_a_session_writes_liveness_once_a_period_and_then_sees_a_revoked_token(
    worker_session, settings, monkeypatch
):
    """Every frame is a touch here (the group joined again), but last_seen_at is written, and
    the token checked, once per touch period (2 s for a timeout of 8 s)."""
    from sessions import presence

    monkeypatch.setattr(presence, "TOUCH_EVERY_SECS", 0.0)
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 8}
    worker, session = await worker_session()
    await session.connect()
    await session.hello()

    def seen():
        return q(lambda: Worker.objects.get(pk=worker.pk).last_seen_at)

    def revoke(at):
        return q(lambda: Worker.objects.filter(pk=worker.pk).update(revoked_at=at))

    def slot_recorded():
        return q(
            lambda: list(
                IdleSlot.objects.filter(worker=worker).values_list("recorded_at", flat=True)
            )
        )

    async def touched(before):
        """A RequestJob (nothing to do: an idle slot), queued behind the frame's touch: once
        its slot is recorded anew, the touch was handled."""
        await session.send({"type": "RequestJob", "kind": "build"})
        for _ in range(100):
            now = await slot_recorded()
            if now and (not before or now[0] > before[0]):
                return now
            await asyncio.sleep(0.05)
        raise AssertionError("the RequestJob after the touch was not handled")

    attached = await seen()
    await revoke(timezone.now())  # in the table alone: no message to the session

    slot = await touched(None)
    # Within the period: nothing written, still open.
    assert await seen() == attached
    assert await session.silent(0)
    await revoke(None)
    await asyncio.sleep(liveness.touch_every() + 0.1)  # a touch period since the attach
    await touched(slot)
    assert await seen() > attached
    assert await session.silent(0)
    await revoke(timezone.now())
    await asyncio.sleep(liveness.touch_every() + 0.1)  # a touch period since the last write
    await session.send({"type": "Draining"})
    assert await session.ws.receive_output(3) == {"type": "websocket.close", "code": 4403}
    await session.close()


def test_a_session_touches_every_few_seconds_of_frames_and_writes_liveness_once_a_period(
    settings,
):
    """A frame brings a touch (the group joined again) once TOUCH_EVERY_SECS have passed since
    the last; liveness is written at the first touch a whole touch period after the last write
    (the attach counts as one)."""
    from sessions.frame_queue import Touch
    from sessions.presence import TOUCH_EVERY_SECS, Presence

    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 48}  # a write every 12 s
    presence = Presence(None, 1, "w", "channel")
    presence.touched = presence.seen = 100.0  # as attach() leaves them
    step = TOUCH_EVERY_SECS
    assert presence.due(100.0 + step - 0.1) is None
    assert presence.due(100.0 + step) == Touch(liveness=False)
    assert presence.due(100.0 + step + 1) is None  # counted from the last touch
    assert presence.due(100.0 + 2 * step) == Touch(liveness=False)
    assert presence.due(112.0) is None  # a period since the write, but no touch due yet
    assert presence.due(100.0 + 3 * step) == Touch(liveness=True)
    assert presence.due(100.0 + 4 * step) == Touch(liveness=False)
