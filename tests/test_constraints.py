"""Every constraint of the spec's Tables section, enforced by PostgreSQL itself.

Each violating row is written with raw SQL, so nothing in Python can be what refuses it.
"""

import uuid

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from clusters.models import ClusterAttempt, ClusterJob, ClusterMember
from gradient.jobs.models import DispatchedJob
from tests.factories import (
    BuildFactory,
    ClusterFactory,
    EvalMemberFactory,
    EvaluationFactory,
    WorkerFactory,
)

pytestmark = pytest.mark.django_db


# The spec's names (its CHECK is unnamed there; ours is cluster_member-one-job).
ONE_JOB = "cluster_member-one-job"
ONE_CLUSTER_PER_EVALUATION = "idx-cluster_member-evaluation"
ONE_CLUSTER_PER_BUILD = "idx-cluster_member-derivation_build"
ONE_OPEN_ATTEMPT = "idx-cluster_attempt-open"
ONE_OPEN_ASSIGNMENT = "idx-dispatched_job-open-job"


def refused(raw_sql, sql, params, constraint):
    """The statement fails on PostgreSQL's constraint of that name, not on any other."""
    with pytest.raises(IntegrityError) as failed, transaction.atomic():
        raw_sql(sql, params)
    assert failed.value.__cause__.diag.constraint_name == constraint


MEMBER_SQL = (
    "INSERT INTO cluster_member (cluster_job_id, evaluation_id, derivation_build_id, role,"
    ' "primary") VALUES (%s, %s, %s, %s, false)'
)


def test_a_member_naming_no_job_is_refused(raw_sql):
    cluster = ClusterFactory()
    refused(raw_sql, MEMBER_SQL, [cluster.pk, None, None, "server"], ONE_JOB)
    assert not ClusterMember.objects.exists()


def test_a_member_naming_both_jobs_is_refused(raw_sql):
    cluster = ClusterFactory()
    evaluation, build = EvaluationFactory(), BuildFactory()
    refused(raw_sql, MEMBER_SQL, [cluster.pk, evaluation.pk, build.pk, "server"], ONE_JOB)
    raw_sql(MEMBER_SQL, [cluster.pk, evaluation.pk, None, "server"])
    raw_sql(MEMBER_SQL, [cluster.pk, None, build.pk, "client"])
    assert ClusterMember.objects.count() == 2


def test_the_one_job_check_is_the_specs_expression(raw_sql):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = %s", [ONE_JOB]
        )
        (definition,) = cursor.fetchone()
    assert definition == "CHECK ((num_nonnulls(evaluation_id, derivation_build_id) = 1))"


def test_an_evaluation_joins_at_most_one_cluster(raw_sql):
    evaluation = EvaluationFactory()
    first, second = ClusterFactory(), ClusterFactory()
    raw_sql(MEMBER_SQL, [first.pk, evaluation.pk, None, "server"])
    for cluster, role in ((second, "server"), (first, "client")):
        params = [cluster.pk, evaluation.pk, None, role]
        refused(raw_sql, MEMBER_SQL, params, ONE_CLUSTER_PER_EVALUATION)


def test_a_shared_build_joins_at_most_one_cluster(raw_sql):
    build = BuildFactory()
    first, second = ClusterFactory(), ClusterFactory()
    raw_sql(MEMBER_SQL, [first.pk, None, build.pk, "server"])
    refused(raw_sql, MEMBER_SQL, [second.pk, None, build.pk, "server"], ONE_CLUSTER_PER_BUILD)


ATTEMPT_SQL = (
    "INSERT INTO cluster_attempt (id, cluster_job_id, created_at, finished_at)"
    " VALUES (%s, %s, now(), %s)"
)


def test_a_cluster_has_at_most_one_open_attempt(raw_sql):
    cluster = ClusterFactory()
    raw_sql(ATTEMPT_SQL, [uuid.uuid4(), cluster.pk, timezone.now()])
    raw_sql(ATTEMPT_SQL, [uuid.uuid4(), cluster.pk, None])
    refused(raw_sql, ATTEMPT_SQL, [uuid.uuid4(), cluster.pk, None], ONE_OPEN_ATTEMPT)
    # Another cluster's open attempt is independent.
    raw_sql(ATTEMPT_SQL, [uuid.uuid4(), ClusterFactory().pk, None])
    assert ClusterAttempt.objects.filter(finished_at__isnull=True).count() == 2


DISPATCH_SQL = (
    "INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, worker_id, project_id, steps,"
    " dispatched_at, finished_at, cluster_attempt_id)"
    " VALUES (%s, 'eval', %s, %s, %s, %s, '{}', now(), %s, %s)"
)


def dispatch_params(evaluation, worker, finished_at=None, attempt=None):
    return [
        uuid.uuid4(),
        f"eval:{evaluation.pk}",
        evaluation.pk,
        worker.pk,
        evaluation.project_id,
        finished_at,
        attempt,
    ]


def test_a_job_key_has_at_most_one_open_assignment(raw_sql):
    evaluation, worker = EvaluationFactory(), WorkerFactory()
    raw_sql(DISPATCH_SQL, dispatch_params(evaluation, worker, finished_at=timezone.now()))
    raw_sql(DISPATCH_SQL, dispatch_params(evaluation, worker))
    params = dispatch_params(evaluation, WorkerFactory())
    refused(raw_sql, DISPATCH_SQL, params, ONE_OPEN_ASSIGNMENT)
    assert DispatchedJob.objects.filter(finished_at__isnull=True).count() == 1


def test_deleting_an_attempt_keeps_its_member_rows_as_telemetry(raw_sql):
    member = EvalMemberFactory()
    worker = WorkerFactory()
    attempt = uuid.uuid4()
    raw_sql(ATTEMPT_SQL, [attempt, member.cluster_job_id, timezone.now()])
    raw_sql(
        DISPATCH_SQL,
        dispatch_params(member.evaluation, worker, finished_at=timezone.now(), attempt=attempt),
    )
    raw_sql("DELETE FROM cluster_attempt WHERE id = %s", [attempt])
    row = DispatchedJob.objects.get()
    assert row.cluster_attempt_id is None
    assert row.job_id == f"eval:{member.evaluation_id}"


def test_deleting_a_cluster_job_removes_members_and_attempts_and_keeps_their_rows(raw_sql):
    member = EvalMemberFactory()
    cluster = member.cluster_job
    attempts = [uuid.uuid4(), uuid.uuid4()]
    for attempt in attempts:
        raw_sql(ATTEMPT_SQL, [attempt, cluster.pk, timezone.now()])
        raw_sql(
            DISPATCH_SQL,
            dispatch_params(
                member.evaluation, WorkerFactory(), finished_at=timezone.now(), attempt=attempt
            ),
        )
    other = EvalMemberFactory()
    other_attempt = uuid.uuid4()
    raw_sql(ATTEMPT_SQL, [other_attempt, other.cluster_job_id, None])
    raw_sql(DISPATCH_SQL, dispatch_params(other.evaluation, WorkerFactory(), attempt=other_attempt))

    raw_sql("DELETE FROM cluster_job WHERE id = %s", [cluster.pk])

    assert not ClusterJob.objects.filter(pk=cluster.pk).exists()
    assert list(ClusterMember.objects.all()) == [other]
    assert list(ClusterAttempt.objects.values_list("pk", flat=True)) == [other_attempt]
    rows = DispatchedJob.objects.values_list("job_id", "cluster_attempt_id")
    assert sorted(rows, key=str) == sorted(
        [(member.job_key, None), (member.job_key, None), (other.job_key, other_attempt)], key=str
    )


def test_garbage_collecting_a_member_job_removes_the_member(raw_sql):
    member = EvalMemberFactory()
    sibling = EvalMemberFactory(cluster_job=member.cluster_job, role="client")
    raw_sql("DELETE FROM evaluation WHERE id = %s", [member.evaluation_id])
    assert list(ClusterMember.objects.all()) == [sibling]
    build_member = ClusterMember.objects.create(
        cluster_job=member.cluster_job, derivation_build=BuildFactory(), role="db"
    )
    raw_sql("DELETE FROM derivation_build WHERE id = %s", [build_member.derivation_build_id])
    assert list(ClusterMember.objects.all()) == [sibling]


# The columns a cascade or a lookup finds rows by, each with the one index that leads with it,
# and a value of the column's type to look up.
SINGLY_INDEXED = [
    ("cluster_member", "evaluation_id", ONE_CLUSTER_PER_EVALUATION, "gen_random_uuid()"),
    ("cluster_member", "derivation_build_id", ONE_CLUSTER_PER_BUILD, "gen_random_uuid()"),
    ("idle_slot", "worker_id", "idx-idle_slot-worker-kind", "1"),
]


@pytest.mark.parametrize(("table", "column", "index", "value"), SINGLY_INDEXED)
def test_a_lookup_column_has_one_index_and_a_generic_plan_uses_it(table, column, index, value):
    """A second index leading with the same column costs every insert and delete a write for
    nothing: the unique one serves the lookups, a cascade's prepared one included."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT array_agg(i.indexrelid::regclass::text) FROM pg_index i
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
            WHERE i.indrelid = %s::regclass AND a.attname = %s
            """,
            [table, column],
        )
        assert cursor.fetchone()[0] == [f'"{index}"']
        with transaction.atomic():
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute(f"PREPARE lookup AS DELETE FROM {table} WHERE {column} = $1")
            try:
                cursor.execute(f"EXPLAIN EXECUTE lookup({value})")
                plan = "\n".join(row[0] for row in cursor.fetchall())
            finally:
                cursor.execute("DEALLOCATE lookup")
    assert f'"{index}"' in plan
