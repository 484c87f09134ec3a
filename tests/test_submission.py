"""clusters.submission: member SPECs parsed, and a cluster created with its jobs in one
transaction; clusters.history: the cluster as show_cluster prints it."""

import re

import pytest

from clusters.history import describe_cluster
from clusters.models import ClusterAttempt, ClusterJob, ClusterStatus
from clusters.submission import MemberSpec, check_members, parse_member, submit_cluster
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from gradient.jobs.submission import JobSpec, SubmissionError
from tests.factories import ProjectFactory, WorkerFactory


def test_a_full_spec_names_every_part_of_its_member():
    member = parse_member(
        "server:build:primary:pin=w1:arch=aarch64-linux:features=kvm+big:paths=/a+/b"
    )

    assert member == MemberSpec(
        role="server",
        job=JobSpec(
            kind="build",
            architecture="aarch64-linux",
            required_features=("kvm", "big"),
            paths=("/a", "/b"),
        ),
        primary=True,
        pin="w1",
    )


def test_options_may_come_in_any_order():
    assert parse_member("c:eval:pin=w:primary") == MemberSpec(
        role="c", job=JobSpec(kind="eval"), primary=True, pin="w"
    )


def test_a_bare_spec_is_an_unpinned_non_primary_member_with_default_fields():
    assert parse_member("client:eval") == MemberSpec(role="client", job=JobSpec(kind="eval"))


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("server", "expected ROLE:KIND"),
        (":eval", "empty role"),
        ("  :eval", "empty role"),
        ("server:vm", "unknown kind 'vm'"),
        ("server:", "unknown kind ''"),
        ("server:eval:zone=a", "unknown option 'zone=a'"),
        ("server:eval:fast", "unknown option 'fast'"),
        ("server:eval::primary", "empty option"),
        ("server:eval:arch=a:arch=b", "arch given more than once"),
        ("server:eval:primary:primary", "primary given more than once"),
        ("server:eval:primary=yes", "primary takes no value"),
        ("server:eval:pin", "pin needs a value"),
        ("server:eval:pin=", "pin needs a value"),
        ("server:eval:features=kvm++big", "features 'kvm++big' has an empty item"),
        ("r" * 101 + ":eval", "role is longer than 100"),
        ("server:eval:arch=" + "x" * 65, "architecture must be 1 to 64"),
    ],
)
def test_a_malformed_spec_is_refused_with_what_is_wrong(spec, error):
    with pytest.raises(SubmissionError, match=re.escape(error)) as refused:
        parse_member(spec)
    assert repr(spec) in str(refused.value)


def test_a_cluster_needs_a_member():
    with pytest.raises(SubmissionError, match="at least one --member"):
        check_members([])


def test_a_second_primary_is_refused():
    with pytest.raises(SubmissionError, match="more than one primary"):
        check_members([parse_member("a:eval:primary"), parse_member("b:build:primary")])


@pytest.mark.django_db
def test_a_submitted_cluster_and_its_member_jobs_are_queued():
    project = ProjectFactory(name="p")
    WorkerFactory(name="w1")
    members = [parse_member("server:eval:primary:pin=w1"), parse_member("client:build:arch=riscv")]

    cluster, rows = submit_cluster("p", members, same_zone=True, retry_budget=2)

    cluster.refresh_from_db()
    assert (cluster.project, cluster.status, cluster.same_zone, cluster.retry_budget) == (
        project,
        ClusterStatus.QUEUED,
        True,
        2,
    )
    assert [(r.role, r.kind, r.primary, r.pin) for r in rows] == [
        ("server", "eval", True, "w1"),
        ("client", "build", False, None),
    ]
    evaluation = Evaluation.objects.get()
    build = DerivationBuild.objects.get()
    assert (evaluation.status, evaluation.project, evaluation.prioritized) == (
        EvaluationStatus.QUEUED,
        project,
        False,
    )
    assert (build.status, build.architecture) == (BuildStatus.QUEUED, "riscv")
    assert [r.job_key for r in rows] == [evaluation.job_key, build.job_key]


@pytest.mark.django_db
def test_prioritized_marks_every_member_job():
    ProjectFactory(name="p")

    submit_cluster("p", [parse_member("a:eval"), parse_member("b:build")], prioritized=True)

    assert Evaluation.objects.get().prioritized
    assert DerivationBuild.objects.get().prioritized


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["a:eval:pin=w", "b:eval:pin=w"], "pinned twice: 'w'"),
        (["a:eval:pin=gone"], "revoked worker(s): 'gone'"),
        (["a:eval:pin=elsewhere"], "without access to project 'p': 'elsewhere'"),
    ],
)
def test_a_pin_that_can_never_seat_its_member_is_refused(specs, message):
    from django.utils import timezone

    project = ProjectFactory(name="p")
    WorkerFactory(name="w")
    WorkerFactory(name="gone", revoked_at=timezone.now())
    WorkerFactory(name="elsewhere", all_projects=False)
    members = [parse_member(s) for s in specs]

    with pytest.raises(SubmissionError, match=re.escape(message)):
        submit_cluster(project.name, members)

    assert not Evaluation.objects.exists()
    assert not ClusterJob.objects.exists()


@pytest.mark.django_db
def test_a_pin_naming_an_unknown_worker_is_refused_before_any_write():
    ProjectFactory(name="p")
    WorkerFactory(name="known")
    members = [parse_member("a:eval:pin=known"), parse_member("b:eval:pin=ghost")]

    with pytest.raises(SubmissionError, match=r"unknown worker\(s\): 'ghost'$"):
        submit_cluster("p", members)

    assert not Evaluation.objects.exists()
    assert not ClusterJob.objects.exists()


@pytest.mark.django_db
def test_a_negative_retry_budget_is_refused():
    ProjectFactory(name="p")
    with pytest.raises(SubmissionError, match="retry budget must not be negative"):
        submit_cluster("p", [parse_member("a:eval")], retry_budget=-1)
    assert not ClusterJob.objects.exists()


@pytest.mark.django_db
def test_a_retry_budget_beyond_the_integer_column_is_refused_not_stored_wrapped():
    ProjectFactory(name="p")
    with pytest.raises(SubmissionError, match="retry budget must be at most 2147483647"):
        submit_cluster("p", [parse_member("a:eval")], retry_budget=2**31)
    assert not ClusterJob.objects.exists()

    cluster, _ = submit_cluster("p", [parse_member("a:eval")], retry_budget=2**31 - 1)

    cluster.refresh_from_db()
    assert cluster.retry_budget == 2**31 - 1


@pytest.mark.django_db
def test_members_of_one_role_are_indexed_from_zero_in_creation_order():
    ProjectFactory(name="p")
    specs = ["node:eval", "lead:build", "node:build", "node:eval"]
    cluster, rows = submit_cluster("p", [parse_member(s) for s in specs])
    worker = WorkerFactory(name="w")
    attempt = ClusterAttempt.objects.create(cluster_job=cluster, created_at=cluster.created_at)
    for row in rows:
        DispatchedJob.objects.create(
            kind=row.kind,
            job_id=row.job_key,
            worker=worker,
            project=cluster.project,
            dispatched_at=attempt.created_at,
            cluster_attempt=attempt,
        )

    seats = describe_cluster(cluster)["history"][0]["seats"]

    assert [(s["role"], s["index"], s["job_id"]) for s in seats] == [
        ("lead", 0, rows[1].job_key),
        ("node", 0, rows[0].job_key),
        ("node", 1, rows[2].job_key),
        ("node", 2, rows[3].job_key),
    ]


@pytest.mark.django_db
def test_describing_a_cluster_takes_three_queries_however_many_attempts(
    django_assert_num_queries,
):
    ProjectFactory(name="p")
    cluster, rows = submit_cluster("p", [parse_member("m:eval") for _ in range(3)])
    worker = WorkerFactory(name="w")
    for _ in range(4):
        attempt = ClusterAttempt.objects.create(
            cluster_job=cluster, created_at=cluster.created_at, finished_at=cluster.created_at
        )
        for row in rows:
            DispatchedJob.objects.create(
                kind=row.kind,
                job_id=row.job_key,
                worker=worker,
                project=cluster.project,
                dispatched_at=attempt.created_at,
                finished_at=attempt.created_at,
                cluster_attempt=attempt,
            )
    cluster = ClusterJob.objects.get()

    with django_assert_num_queries(3):
        history = describe_cluster(cluster)["history"]

    assert [len(a["seats"]) for a in history] == [3, 3, 3, 3]
