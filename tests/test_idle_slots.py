"""Idle slots, the planner's only view of free capacity (workers.assignment.record_idle)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from sessions.request_job import answer_request
from tests.clusterflow import wait_for_lock_waits
from tests.concurrency import frozen_connection, race
from tests.factories import BuildFactory, ProjectFactory, WorkerFactory
from workers.assignment import record_idle
from workers.models import IdleSlot


@pytest.fixture(autouse=True)
def no_wake(monkeypatch):
    monkeypatch.setattr("sessions.request_job.wake_dispatch", lambda: True)


def slots(worker) -> set[str]:
    return set(IdleSlot.objects.filter(worker=worker).values_list("kind", flat=True))


@pytest.mark.django_db
def test_a_worker_with_room_has_its_idle_slot_recorded_and_refreshed():
    worker = WorkerFactory()
    record_idle(worker.pk, "build")
    first = IdleSlot.objects.get(worker=worker).recorded_at
    record_idle(worker.pk, "build")
    assert slots(worker) == {"build"}
    assert IdleSlot.objects.get(worker=worker).recorded_at > first


@pytest.mark.django_db
def test_a_worker_seated_since_its_request_counted_gets_no_idle_slot_of_that_kind():
    """A claim that filled the worker's slots between the RequestJob's count and its idle slot
    (here: a build assigned meanwhile) must not leave a slot behind for the next placement."""
    worker = WorkerFactory(max_concurrent_builds=1)
    BuildFactory(project=ProjectFactory())
    assign = answer_request(worker.pk, "build")
    assert assign is not None and slots(worker) == set()
    record_idle(worker.pk, "build")  # the late write of a RequestJob that saw the slot free
    record_idle(worker.pk, "eval")
    assert slots(worker) == {"eval"}


@pytest.mark.django_db
def test_a_resend_refreshes_its_slot_in_place_and_wakes_the_pass_only_for_a_slot_it_has_not_seen(
    settings,
):
    worker = WorkerFactory(max_concurrent_builds=1)
    assert record_idle(worker.pk, "build")  # new: a pass may now place a cluster
    first = IdleSlot.objects.get(worker=worker).recorded_at
    assert not record_idle(worker.pk, "build", resend=True)
    assert IdleSlot.objects.get(worker=worker).recorded_at > first
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"] + 1)
    IdleSlot.objects.filter(worker=worker).update(recorded_at=timezone.now() - ttl)
    assert record_idle(worker.pk, "build", resend=True)  # the planner had stopped trusting it
    IdleSlot.objects.filter(worker=worker).delete()
    assert record_idle(worker.pk, "build", resend=True)  # gone: recorded again, room counted
    assert slots(worker) == {"build"}


@pytest.mark.django_db
def test_a_resend_after_a_claim_took_the_slot_does_not_put_it_back():
    worker = WorkerFactory(max_concurrent_builds=1)
    record_idle(worker.pk, "build")
    BuildFactory(project=ProjectFactory())
    assert answer_request(worker.pk, "build") is not None  # the claim deletes the slot
    assert record_idle(worker.pk, "build", resend=True)
    assert slots(worker) == set()


@pytest.mark.parametrize("resend", [False, True], ids=["request", "resend"])
@pytest.mark.django_db(transaction=True)
def test_a_request_that_counted_before_a_claim_committed_leaves_no_idle_slot_behind(resend):
    """A resend can reach the idle slot while a claim seats its worker on it: the claim holds
    the slot's row and has written its assignment, uncommitted. Counted from before the
    commit, the worker would have room and the slot would be written again once the claim
    deletes it; the next pass would seat the worker twice, and it would refuse the second
    member."""
    worker = WorkerFactory(max_concurrent_evals=1)
    record_idle(worker.pk, "eval")
    claim = frozen_connection()
    try:
        claim.execute(
            "SELECT 1 FROM idle_slot WHERE worker_id = %s AND kind = 'eval' FOR UPDATE",
            [worker.pk],
        )
        claim.execute(
            "INSERT INTO dispatched_job (id, kind, job_id, worker_id, project_id, steps,"
            " dispatched_at) VALUES (gen_random_uuid(), 'eval', %s, %s, %s, '{}', now())",
            ["eval:00000000-0000-0000-0000-000000000001", worker.pk, ProjectFactory().pk],
        )
        claim.execute("DELETE FROM idle_slot WHERE worker_id = %s", [worker.pk])

        def commit_once_waited_on():
            try:
                return wait_for_lock_waits(1)
            finally:
                claim.commit()

        _, waited = race(lambda: record_idle(worker.pk, "eval", resend), commit_once_waited_on)
        assert waited
    finally:
        claim.close()
    assert slots(worker) == set()
