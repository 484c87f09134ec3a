"""JobOffer: the head of the queue offered to a worker, once per job and connection
(workers.offers, workers.head, clusters.head.member_head_parts)."""

import pytest
from django.db import connection as db_connection
from django.utils import timezone

from clusters.models import ClusterJob
from gradient.jobs.models import DerivationBuild, Evaluation
from gradient.wire.protocol import Score
from sessions import connection
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    EvalMemberFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    waiting,
)
from tests.plans import clusters_with_history, rows_read, scans
from workers import health, offers
from workers.head import offerable, read_singles
from workers.models import JobScore

pytestmark = pytest.mark.django_db


def offered(worker, memory=None) -> list[str]:
    """What an offer to the worker names: one connection's offers when they share `memory`."""
    worker.refresh_from_db()
    offer = offers.offer_head(worker, memory, member_parts(worker)).offer
    return [] if offer is None else sorted(job.job_id for job in offer.jobs)


def member_parts(worker):
    from clusters.head import member_head_parts

    return member_head_parts(worker)


def window(settings, n):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": n}


def by_age(model, jobs):
    keys = model.objects.filter(pk__in=[j.pk for j in jobs]).order_by("created_at")
    return [j.job_key for j in keys]


def test_both_kinds_and_the_waiting_clusters_members_are_offered_once():
    worker, memory = WorkerFactory(), offers.Offered()
    build, evaluation = BuildFactory(), EvaluationFactory()
    member = EvalMemberFactory()
    waiting(member)
    keys = sorted([build.job_key, evaluation.job_key, member.job_key])
    assert offered(worker, memory) == keys
    assert offered(worker, memory) == []  # once per connection, answered or not
    # The single jobs are remembered by the session, the member by a row without a score.
    assert memory.sizes == {build.job_key: None, evaluation.job_key: None}
    rows = JobScore.objects.filter(worker=worker)
    assert list(rows.values_list("job_id", "missing_nar_size")) == [(member.job_key, None)]
    score = Score(job_id=member.job_key, missing_count=1, missing_nar_size=5)
    single = Score(job_id=build.job_key, missing_count=1, missing_nar_size=7)
    assert memory.record([score, single]) == [score]
    offers.record_scores(worker.pk, [score])
    assert memory.sizes[build.job_key] == 7
    assert list(rows.values_list("missing_nar_size", flat=True)) == [5]
    assert offered(worker, memory) == []


def test_a_new_connection_is_offered_its_head_again():
    worker = WorkerFactory()
    member = waiting(BuildMemberFactory())
    assert offered(worker, offers.Offered()) == [member.job_key]
    assert offered(worker, offers.Offered()) == []  # its row: offered on this connection
    connection.attach(worker.pk, "channel-2")
    assert offered(worker, offers.Offered()) == [member.job_key]


def test_members_of_a_cluster_no_pass_has_seen_waiting_are_not_offered_yet():
    worker = WorkerFactory()
    member = BuildMemberFactory()
    assert offered(worker) == []
    waiting(member)
    assert offered(worker) == [member.job_key]


def test_only_the_window_is_offered_oldest_first_and_the_rest_as_the_head_moves(settings):
    window(settings, 2)
    worker, memory = WorkerFactory(can_eval=False), offers.Offered()
    jobs = by_age(DerivationBuild, BuildFactory.create_batch(5))
    assert offered(worker, memory) == sorted(jobs[:2])
    DerivationBuild.objects.filter(pk=jobs[0].split(":")[1]).update(status="Building")
    assert offered(worker, memory) == [jobs[2]]
    # The job that left the head is forgotten: the session keeps its head alone.
    assert sorted(memory.sizes) == sorted(jobs[1:3])


def test_a_members_row_goes_once_its_job_left_the_head(settings):
    window(settings, 1)
    worker = WorkerFactory(can_eval=False)
    first, second = BuildMemberFactory(), BuildMemberFactory()
    waiting(first, second)
    assert offered(worker) == [first.job_key]
    ClusterJob.objects.filter(pk=first.cluster_job_id).update(waiting_since=None)  # placed
    assert offered(worker) == [second.job_key]
    # Kept while fresh: the pass offers a cluster before it marks it waiting.
    assert JobScore.objects.count() == 2
    JobScore.objects.update(offered_at=timezone.now() - offers.OFFER_GRACE)
    assert offered(worker) == []
    assert list(JobScore.objects.values_list("job_id", flat=True)) == [second.job_key]


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


def test_a_quarantined_worker_is_offered_single_jobs_but_no_member():
    worker, memory = WorkerFactory(), offers.Offered()
    single, member = BuildFactory(), BuildMemberFactory()
    waiting(member)
    # Quarantined after its row was read for the session: the offer reads the row itself.
    health.quarantine(worker, "flaky")
    head = offers.offer_head(worker, memory, member_parts(worker))
    assert sorted(job.job_id for job in head.offer.jobs) == [single.job_key]
    assert not JobScore.objects.filter(worker=worker).exists()
    health.release(worker)
    assert offered(worker, memory) == [member.job_key]


def test_a_draining_worker_is_offered_nothing():
    worker = WorkerFactory(draining=True)
    BuildFactory()
    assert offered(worker) == []


def test_members_offered_by_the_dispatch_pass_are_not_offered_again():
    worker = WorkerFactory()
    member = BuildMemberFactory()
    waiting(member)
    JobScore.objects.create(worker=worker, job_id=member.job_key, offered_at=timezone.now())
    assert offered(worker) == []


def head_walks(call) -> dict[str, int]:
    """The rows each scan of a job table read when the call's last statement ran again:
    index name (or "seq scan") -> rows read."""
    read: dict[str, int] = {}
    for node, rows in scans(call, ("evaluation", "derivation_build")):
        name = node.get("Index Name", "seq scan")
        read[name] = read.get(name, 0) + rows
    return read


def test_the_head_is_read_by_index_to_the_window_whatever_the_queue_behind_it():
    """A deep queue, finished evaluations piling up until garbage collection: the offer and
    the single path walk each kind's index and stop at the window."""
    worker, project = WorkerFactory(), ProjectFactory()
    Evaluation.objects.bulk_create(
        Evaluation(project=project, status=status)
        for status in ["Queued"] * 2000 + ["Completed"] * 2000
    )
    DerivationBuild.objects.bulk_create(
        DerivationBuild(project=project, status="Queued") for _ in range(2000)
    )
    with db_connection.cursor() as cursor:
        cursor.execute("ANALYZE evaluation, derivation_build")
    for call, walks in (
        (lambda: offered(worker), {"idx-evaluation-head", "idx-derivation_build-head"}),
        (lambda: read_singles(worker, offerable(worker, "eval")), {"idx-evaluation-head"}),
        (lambda: read_singles(worker, offerable(worker, "build")), {"idx-derivation_build-head"}),
    ):
        read = {name: rows for name, rows in head_walks(call).items() if rows}
        assert set(read) == walks, read
        assert all(rows <= 32 + 1 for rows in read.values()), read


def test_a_worker_of_one_project_reads_none_of_another_projects_deep_queue():
    """Its project has nothing queued, another has thousands: PostgreSQL guessed that a
    project filter keeps half the rows and walked the whole queue's index to fill the window."""
    mine, busy = ProjectFactory(), ProjectFactory()
    worker = WorkerFactory(all_projects=False)
    worker.projects.set([mine])
    Evaluation.objects.bulk_create(Evaluation(project=busy) for _ in range(2000))
    DerivationBuild.objects.bulk_create(
        DerivationBuild(project=busy, status="Queued") for _ in range(2000)
    )
    with db_connection.cursor() as cursor:
        cursor.execute("ANALYZE evaluation, derivation_build")
    for call in (
        lambda: offered(worker),
        lambda: read_singles(worker, offerable(worker, "eval")),
        lambda: read_singles(worker, offerable(worker, "build")),
    ):
        read = head_walks(call)
        assert sum(read.values()) == 0, read
    Evaluation.objects.bulk_create(Evaluation(project=mine) for _ in range(40))
    assert len(read_singles(worker, offerable(worker, "eval"))) == 32


def member_reads(call) -> dict[str, int]:
    """The rows of cluster_member and of each job table that the call's last statement read."""
    return rows_read(call, ("evaluation", "derivation_build", "cluster_member"))


@pytest.mark.parametrize("all_projects", [True, False])
def test_the_members_head_is_read_cluster_by_cluster_to_the_window(all_projects, analyzed):
    """300 clusters waiting and 1,000 finished behind them, as on a busy fleet: PostgreSQL
    guessed that few members of waiting clusters are queued (most job rows are history) and
    hash-joined every member and job row instead of walking the clusters in order."""
    project = ProjectFactory()
    worker = WorkerFactory(all_projects=all_projects)
    worker.projects.set([project])
    clusters_with_history(project, queued=300, finished=1000)
    analyzed()
    read = member_reads(lambda: offered(worker))
    # Each kind's walk reads the clusters of its window, whatever the queue or the history
    # behind them: their three member rows twice (whether the worker could seat one, then
    # which) and three probes of its job table.
    members, jobs = 2 * 32 * 3 * 2, 2 * 32 * 3
    assert read["cluster_member"] <= members, read
    assert read["evaluation"] + read["derivation_build"] <= 2 * jobs, read
    assert JobScore.objects.filter(worker=worker).count() == 2 * 32


def test_a_request_is_offered_the_head_of_its_own_kind():
    worker, memory = WorkerFactory(), offers.Offered()
    build, evaluation = BuildFactory(), EvaluationFactory()
    worker.refresh_from_db()
    head = offers.offer_head(worker, memory, member_parts(worker), kinds=("build",))
    assert [j.job_id for j in head.offer.jobs] == [build.job_key]
    assert memory.sizes == {build.job_key: None}
    head = offers.offer_head(worker, memory, member_parts(worker), kinds=("eval",))
    assert [j.job_id for j in head.offer.jobs] == [evaluation.job_key]
    assert set(memory.sizes) == {build.job_key, evaluation.job_key}  # the build is kept


@pytest.mark.parametrize("all_projects", [True, False])
def test_the_members_head_reads_the_window_of_clusters_whatever_the_statistics(
    all_projects, analyzed
):
    """Statistics taken while no cluster waited, then 300 queued: trusting them, PostgreSQL
    walked the members of every waiting cluster and sorted them all to find the window."""
    project = ProjectFactory()
    worker = WorkerFactory(all_projects=all_projects)
    worker.projects.set([project])
    clusters_with_history(project, queued=0, finished=1000)
    analyzed()
    clusters_with_history(project, queued=300, finished=0)
    read = rows_read(lambda: offered(worker), ("cluster_job",))
    # Each kind's walk reads the clusters of its window at most, whatever the queue.
    assert read["cluster_job"] <= 2 * 32, read
    assert JobScore.objects.filter(worker=worker).count() == 2 * 32


def test_a_cluster_the_worker_cannot_seat_takes_no_place_in_its_window(settings):
    window(settings, 1)
    worker = WorkerFactory(can_eval=False)
    waiting(BuildMemberFactory(derivation_build__architecture="riscv64-linux"))
    waiting(BuildMemberFactory(pin="another-worker"))
    seatable = waiting(BuildMemberFactory())
    assert offered(worker) == [seatable.job_key]
