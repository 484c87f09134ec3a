"""Idle slots, the planner's only view of free capacity (workers.assignment.record_idle)."""

import pytest

from sessions.request_job import answer_request
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
