"""The pruning pass over job_score (workers.pruning): rows of jobs that can no longer start go,
the rest stay."""

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from gradient.jobs.models import BuildStatus, EvaluationStatus
from tests.factories import BuildFactory, EvaluationFactory, WorkerFactory, answered_scores
from workers.models import JobScore
from workers.pruning import prune_scores
from workers.tasks import prune_scores as prune_task

pytestmark = pytest.mark.django_db


def scores_for(keys, workers):
    answered_scores((w, key, 7) for key in keys for w in workers)


def kept() -> set[str]:
    return set(JobScore.objects.values_list("job_id", flat=True))


def test_rows_of_finished_deleted_or_unknown_jobs_go_and_the_startable_keep_theirs():
    workers = WorkerFactory.create_batch(2)
    live = [
        EvaluationFactory().job_key,
        EvaluationFactory(status=EvaluationStatus.FETCHING).job_key,
        BuildFactory().job_key,
        BuildFactory(status=BuildStatus.BUILDING).job_key,
        BuildFactory(status=BuildStatus.FAILED_TRANSIENT).job_key,  # will be requeued
        BuildFactory(status=BuildStatus.CREATED).job_key,
    ]
    done = [
        EvaluationFactory(status=EvaluationStatus.COMPLETED).job_key,
        EvaluationFactory(status=EvaluationStatus.ABORTED).job_key,
        BuildFactory(status=BuildStatus.COMPLETED).job_key,
        BuildFactory(status=BuildStatus.SUBSTITUTED).job_key,
        f"eval:{uuid.uuid4()}",  # deleted by garbage collection
        f"build:{uuid.uuid4()}",
        "x",  # a worker may answer for any key
        "eval:not-a-uuid",
        f"build:{uuid.uuid4()}-and-more",
    ]
    scores_for(live + done[:4], workers)
    scores_for(done[4:], workers[:1])
    scores_for(live[:1], [WorkerFactory()])
    assert prune_scores() == 4 * 2 + 5
    assert kept() == set(live)
    assert JobScore.objects.filter(job_id=live[0]).count() == 3
    assert prune_scores() == 0  # nothing left to do


def test_a_backlog_goes_in_batches_of_keys():
    workers = WorkerFactory.create_batch(3)
    done = [EvaluationFactory(status=EvaluationStatus.FAILED).job_key for _ in range(7)]
    live = [EvaluationFactory().job_key for _ in range(3)]
    scores_for(done + live, workers)
    with CaptureQueriesContext(connection) as captured:
        assert prune_scores(batch=2) == 7 * 3
    deletes = [q for q in captured.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 4  # 2 + 2 + 2 + 1 keys
    assert kept() == set(live)
    assert prune_task() == 0  # the Celery task runs the same pass


def test_a_jobs_rows_are_found_through_the_index():
    """The pruning deletes by job key, the dispatch pass reads a job's cheapest scores: both
    through idx-job_score-job-size."""
    workers = WorkerFactory.create_batch(20)
    keys = [EvaluationFactory().job_key for _ in range(100)]
    scores_for(keys, workers)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE job_score")
        for sql in (
            "DELETE FROM job_score WHERE job_id = ANY(%s)",
            "SELECT worker_id FROM job_score WHERE job_id = ANY(%s)"
            " AND missing_nar_size IS NOT NULL ORDER BY job_id, missing_nar_size, worker_id",
        ):
            cursor.execute("EXPLAIN " + sql, [keys[48:52]])
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "idx-job_score-job-size" in plan, plan
            assert "Seq Scan" not in plan, plan
