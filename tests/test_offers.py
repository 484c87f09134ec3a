"""JobOffer: the head of the queue offered to a worker, once per job and connection
(workers.offers, workers.head, clusters.tracking.member_head_parts)."""

import pytest
from django.db import connection as db_connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from gradient.jobs.models import DerivationBuild, Evaluation
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    EvalMemberFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    answered_scores,
    waiting,
)
from workers import connection, offers
from workers.assignment import candidates
from workers.head import offerable
from workers.models import JobScore
from workers.protocol import Score

pytestmark = pytest.mark.django_db


def offered(worker) -> list[str]:
    worker.refresh_from_db()
    offer = offers.offer_head(worker, tracking_parts(worker))
    return [] if offer is None else sorted(job.job_id for job in offer.jobs)


def tracking_parts(worker):
    from clusters.tracking import member_head_parts

    return member_head_parts(worker)


def window(settings, n):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": n}


def by_age(model, jobs):
    keys = model.objects.filter(pk__in=[j.pk for j in jobs]).order_by("created_at")
    return [j.job_key for j in keys]


def test_both_kinds_and_the_waiting_clusters_members_are_offered_once():
    worker = WorkerFactory()
    build, evaluation = BuildFactory(), EvaluationFactory()
    member = EvalMemberFactory()
    waiting(member)
    keys = sorted([build.job_key, evaluation.job_key, member.job_key])
    assert offered(worker) == keys
    rows = JobScore.objects.filter(worker=worker)
    assert sorted(rows.values_list("job_id", flat=True)) == keys
    assert not rows.filter(missing_nar_size__isnull=False).exists()  # offered, not scored
    assert offered(worker) == []  # once per connection, answered or not
    offers.record_scores(
        worker.pk, [Score(job_id=build.job_key, missing_count=1, missing_nar_size=5)]
    )
    assert offered(worker) == []


def test_a_new_connection_is_offered_its_head_again():
    worker = WorkerFactory()
    build = BuildFactory()
    assert offered(worker) == [build.job_key]
    connection.attach(worker.pk, "channel-2")
    assert offered(worker) == [build.job_key]


def test_members_of_a_cluster_no_pass_has_seen_waiting_are_not_offered_yet():
    worker = WorkerFactory()
    member = BuildMemberFactory()
    assert offered(worker) == []
    waiting(member)
    assert offered(worker) == [member.job_key]


def test_only_the_window_is_offered_oldest_first_and_the_rest_as_the_head_moves(settings):
    window(settings, 2)
    worker = WorkerFactory(can_eval=False)
    jobs = by_age(DerivationBuild, BuildFactory.create_batch(5))
    assert offered(worker) == sorted(jobs[:2])
    DerivationBuild.objects.filter(pk=jobs[0].split(":")[1]).update(status="Building")
    assert offered(worker) == [jobs[2]]
    # The job that left the head is forgotten: the worker holds rows for its head alone.
    assert sorted(
        JobScore.objects.filter(worker=worker).values_list("job_id", flat=True)
    ) == sorted(jobs[1:3])


def test_a_prioritized_job_comes_first_whatever_its_age(settings):
    window(settings, 1)
    worker = WorkerFactory(can_build=False)
    EvaluationFactory.create_batch(3)
    urgent = EvaluationFactory(prioritized=True)
    assert offered(worker) == [urgent.job_key]


def test_the_members_part_has_a_window_of_its_own_in_the_planners_order(settings):
    window(settings, 2)
    worker = WorkerFactory(can_eval=False)
    singles = by_age(DerivationBuild, BuildFactory.create_batch(3))
    members = [BuildMemberFactory() for _ in range(3)]
    members[2].cluster_job.prioritized = True
    members[2].cluster_job.save()
    waiting(*members)
    assert offered(worker) == sorted([*singles[:2], members[2].job_key, members[0].job_key])


def test_a_pinned_member_is_offered_to_its_pins_worker_whatever_its_place(settings):
    window(settings, 1)
    worker, other = WorkerFactory(), WorkerFactory()
    first = BuildMemberFactory()
    pinned = BuildMemberFactory(pin=worker.name)
    waiting(first, pinned)
    assert offered(worker) == sorted([first.job_key, pinned.job_key])
    assert offered(other) == [first.job_key]


def test_a_fetch_only_worker_is_offered_no_member_evaluation():
    worker = WorkerFactory(can_eval=False, can_build=False, can_fetch=True)
    single = EvaluationFactory()
    waiting(EvalMemberFactory(), BuildMemberFactory())
    assert offered(worker) == [single.job_key]


def test_jobs_the_worker_cannot_run_are_not_offered():
    worker = WorkerFactory()
    BuildFactory(architecture="riscv64-linux")
    BuildFactory(required_features=["kvm"])
    waiting(BuildMemberFactory(derivation_build__required_features=["kvm"]))
    assert offered(worker) == []


def test_a_draining_worker_is_offered_nothing():
    worker = WorkerFactory(draining=True)
    BuildFactory()
    assert offered(worker) == []


def test_offers_made_by_the_dispatch_pass_are_not_made_again():
    worker = WorkerFactory()
    member = BuildMemberFactory()
    waiting(member)
    JobScore.objects.create(worker=worker, job_id=member.job_key, offered_at=timezone.now())
    assert offered(worker) == []


def head_walks(call) -> dict[str, int]:
    """The rows each scan of a job table read when the call's last statement ran again
    (EXPLAIN ANALYZE): index name (or "seq scan") -> rows read, kept or filtered out."""
    with CaptureQueriesContext(db_connection) as captured:
        call()
    with db_connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + captured.captured_queries[-1]["sql"])
        [[root]] = cursor.fetchone()
    read: dict[str, int] = {}

    def walk(node):
        if node.get("Relation Name") in ("evaluation", "derivation_build"):
            name = node.get("Index Name", "seq scan")
            rows = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node[
                "Actual Loops"
            ]
            read[name] = read.get(name, 0) + rows
        for child in node.get("Plans", ()):
            walk(child)

    walk(root["Plan"])
    return read


def test_the_head_is_read_by_index_to_the_window_whatever_the_queue_behind_it():
    """A deep queue, finished evaluations piling up until garbage collection: the offer and
    the candidates walk each kind's index and stop at the window."""
    worker, project = WorkerFactory(), ProjectFactory()
    Evaluation.objects.bulk_create(
        Evaluation(project=project, status=status)
        for status in ["Queued"] * 2000 + ["Completed"] * 2000
    )
    DerivationBuild.objects.bulk_create(
        DerivationBuild(project=project, status="Queued") for _ in range(2000)
    )
    answered_scores([(worker, e.job_key, 5) for e in Evaluation.objects.all()[:50]])
    with db_connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    for call, walks in (
        (lambda: offered(worker), {"idx-evaluation-head", "idx-derivation_build-head"}),
        (lambda: candidates(worker, offerable(worker, "eval")), {"idx-evaluation-head"}),
        (lambda: candidates(worker, offerable(worker, "build")), {"idx-derivation_build-head"}),
    ):
        read = {name: rows for name, rows in head_walks(call).items() if rows}
        assert set(read) == walks, read
        assert all(rows <= 32 + 1 for rows in read.values()), read
