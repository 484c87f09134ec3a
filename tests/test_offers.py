"""JobOffer: what a worker is offered, once per job and connection (workers.connection)."""

import pytest
from django.db import connection as db_connection
from django.test.utils import CaptureQueriesContext

from gradient.jobs.models import Evaluation
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    EvalMemberFactory,
    EvaluationFactory,
    WorkerFactory,
)
from workers import connection
from workers.assignment import candidates, offerable
from workers.models import JobScore


def offered(worker) -> list[str]:
    offer = connection.new_offers(worker.pk)
    return [] if offer is None else [job.job_id for job in offer.jobs]


@pytest.mark.django_db
def test_both_kinds_are_offered_members_included_and_remembered():
    worker = WorkerFactory()
    build, evaluation = BuildFactory(), EvaluationFactory()
    member = EvalMemberFactory()
    assert sorted(offered(worker)) == sorted([build.job_key, evaluation.job_key, member.job_key])
    assert JobScore.objects.filter(worker=worker, scored_at__isnull=True).count() == 3
    assert offered(worker) == []


@pytest.mark.django_db
def test_a_fetch_only_worker_is_offered_no_member_evaluation():
    worker = WorkerFactory(can_eval=False, can_build=False, can_fetch=True)
    single = EvaluationFactory()
    EvalMemberFactory()
    BuildMemberFactory()
    assert offered(worker) == [single.job_key]


@pytest.mark.django_db
def test_a_long_queue_is_offered_oldest_first_the_rest_at_the_next_request(monkeypatch):
    monkeypatch.setattr(connection, "OFFER_BATCH", 2)
    worker = WorkerFactory(can_build=False)
    jobs = EvaluationFactory.create_batch(3)
    by_age = [
        e.job_key
        for e in Evaluation.objects.filter(pk__in=[j.pk for j in jobs]).order_by("created_at")
    ]
    assert offered(worker) == by_age[:2]
    assert offered(worker) == by_age[2:]


@pytest.mark.django_db
def test_jobs_the_worker_cannot_run_are_not_offered():
    worker = WorkerFactory()
    BuildFactory(architecture="riscv64-linux")
    BuildFactory(required_features=["kvm"])
    assert offered(worker) == []


@pytest.mark.django_db
def test_finished_evaluations_are_not_scanned_for_an_eval_slot():
    """Finished evaluations pile up until garbage collection; the offer and the candidates
    reach the startable ones through idx-evaluation-startable instead of scanning them."""
    worker = WorkerFactory()
    EvaluationFactory.create_batch(3)
    EvaluationFactory.create_batch(3, status="Fetching")
    EvaluationFactory.create_batch(3000, status="Completed")
    with db_connection.cursor() as cursor:
        cursor.execute("ANALYZE evaluation")
    for call in (
        lambda: offered(worker),
        lambda: candidates(worker, offerable(worker, "eval")),
    ):
        with CaptureQueriesContext(db_connection) as captured:
            call()
        with db_connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + captured.captured_queries[-1]["sql"])
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "idx-evaluation-startable" in plan, plan
        assert "Seq Scan on evaluation" not in plan, plan
