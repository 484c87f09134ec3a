"""Asking the idle seats for their scores (clusters.asking, protocol.md): a cluster that
becomes able to start is offered at once to the idle workers that could seat it, and placed on
their answers, or GRADIENT_SCORE_WAIT_MS after the offers for a silent one."""

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from clusters.asking import Asking
from clusters.book import startable_clusters
from clusters.dispatch import run_pass, snapshot
from clusters.models import ClusterAttempt, ClusterJob
from gradient.jobs.models import DispatchedJob
from gradient.wire.protocol import Score
from tests.clusterflow import Inbox, committed, idle_workers
from tests.factories import BuildMemberFactory, ClusterFactory
from workers import offers
from workers.models import IdleSlot, JobScore, Worker

pytestmark = committed


@pytest.fixture(autouse=True)
def _layer(memory_layer, settings):
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 60_000}


def cluster_of_builds(n, **kwargs):
    cluster = ClusterFactory(**kwargs)
    for i in range(n):
        BuildMemberFactory(cluster_job=cluster, role=f"r{i}")
    return cluster


def keys(cluster) -> list[str]:
    return sorted(m.job_key for m in cluster.members.all())


def answer(worker, cluster, size):
    scores = [Score(job_id=k, missing_count=1, missing_nar_size=size) for k in keys(cluster)]
    offers.record_scores(worker.pk, scores)


def seated(cluster) -> set[int]:
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    return set(
        DispatchedJob.objects.filter(cluster_attempt=attempt).values_list("worker", flat=True)
    )


def test_a_new_cluster_is_offered_to_the_idle_seats_and_placed_on_their_answers():
    dear, cheap, cheaper = idle_workers(3, kinds=("build",))
    busy = idle_workers(1, kinds=("eval",))[0]  # no idle build slot: no seat, no offer
    inbox = Inbox([dear, cheap, cheaper, busy])
    cluster = cluster_of_builds(2)
    result = run_pass()
    assert result.claimed == [] and result.waiting_for_scores
    for worker in (dear, cheap, cheaper):
        [offer] = inbox.frames(worker)
        assert offer["type"] == "JobOffer"
        assert sorted(j["job_id"] for j in offer["jobs"]) == keys(cluster)
    assert inbox.frames(busy) == []
    assert JobScore.objects.filter(missing_nar_size__isnull=True).count() == 6
    assert ClusterJob.objects.get(pk=cluster.pk).offered_at is not None

    answer(dear, cluster, 900)
    answer(cheap, cluster, 10)
    assert run_pass().claimed == []  # one seat has not answered yet
    answer(cheaper, cluster, 5)
    assert run_pass().claimed == [cluster.pk]
    assert seated(cluster) == {cheap.pk, cheaper.pk}


def test_a_silent_seat_is_waited_for_no_longer_than_the_score_wait(settings):
    answering, silent = idle_workers(2, kinds=("build",))
    cluster = cluster_of_builds(2)
    run_pass()
    answer(answering, cluster, 10)
    assert run_pass().claimed == []
    ClusterJob.objects.filter(pk=cluster.pk).update(
        offered_at=ClusterJob.objects.get(pk=cluster.pk).offered_at - timedelta(seconds=61)
    )
    assert run_pass().claimed == [cluster.pk]
    assert seated(cluster) == {answering.pk, silent.pk}


def test_a_cluster_its_seats_have_all_scored_is_placed_at_once():
    workers = idle_workers(2, kinds=("build",))
    cluster = cluster_of_builds(2)
    for worker in workers:
        answer(worker, cluster, 1)
    assert run_pass().claimed == [cluster.pk]


def test_new_clusters_beyond_the_head_are_offered_by_a_later_pass(settings):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 2}
    workers = idle_workers(6, kinds=("build",))
    inbox = Inbox(workers)
    first, second = cluster_of_builds(2), cluster_of_builds(2)
    run_pass()
    offered = {j["job_id"] for w in workers for f in inbox.frames(w) for j in f.get("jobs", ())}
    assert offered == set(keys(first))  # the window: two build members
    assert ClusterJob.objects.get(pk=second.pk).offered_at is None
    for worker in workers:
        answer(worker, first, 1)
    assert run_pass().claimed == [first.pk]
    offered = {j["job_id"] for w in workers for f in inbox.frames(w) for j in f.get("jobs", ())}
    assert offered == set(keys(second))


def test_a_new_cluster_beyond_the_head_leaves_its_seats_to_a_cluster_ready_behind_it(settings):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 2}
    workers = idle_workers(4, kinds=("build",))
    first, beyond = cluster_of_builds(2), cluster_of_builds(2)
    # Asked long ago and answered by every seat: placed as soon as it has seats.
    answered = cluster_of_builds(2, offered_at=timezone.now() - timedelta(minutes=5))
    for worker in workers:
        answer(worker, answered, 1)
    result = run_pass()
    # `first` fills the head and waits for its answers on two seats; `beyond` is asked by a
    # later pass, and the two seats it would have had go to `answered`.
    assert result.claimed == [answered.pk]
    assert ClusterJob.objects.get(pk=beyond.pk).offered_at is None
    assert ClusterJob.objects.get(pk=first.pk).offered_at is not None
    assert len(seated(answered)) == 2


def test_with_no_score_wait_a_new_cluster_is_placed_at_once_and_nobody_is_asked(settings):
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 0}
    workers = idle_workers(2, kinds=("build",))
    inbox = Inbox(workers)
    cluster = cluster_of_builds(2)
    assert run_pass().claimed == [cluster.pk]
    frames = [f for w in workers for f in inbox.frames(w)]
    assert {f["type"] for f in frames} == {"AssignJob"}


def test_an_idle_fleet_is_asked_a_window_of_seats_per_member_from_every_zone(settings):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 4}
    workers = idle_workers(10, kinds=("build",), zone="a") + idle_workers(
        10, kinds=("build",), zone="b"
    )
    cluster = cluster_of_builds(1, same_zone=True)
    run_pass()
    asked = Worker.objects.filter(
        pk__in=JobScore.objects.filter(job_id__in=keys(cluster)).values("worker")
    )
    assert sorted(w.zone for w in asked) == ["a", "a", "b", "b"]
    assert len(workers) == 20


def test_a_cluster_is_asked_again_of_seats_that_came_free_since_in_rounds(settings):
    """Seats that came free after a cluster was asked never scored it (it is past their own
    heads): the pass asks them when it would place it there, and holds it for them, but only
    a score wait from the start of a round, the next round a score wait after the last."""
    first = idle_workers(1, kinds=("build",))[0]
    cluster = cluster_of_builds(1)
    run_pass()
    answer(first, cluster, 10)
    round_began = ClusterJob.objects.get(pk=cluster.pk).offered_at
    IdleSlot.objects.filter(worker=first).delete()  # the seat that scored it went busy
    late = idle_workers(1, kinds=("build",))[0]

    def asked_late():
        return JobScore.objects.filter(worker=late, job_id__in=keys(cluster)).exists()

    # In the round (60 s wait): the late seat is asked, and the cluster waits for it.
    assert run_pass().claimed == [] and asked_late()
    JobScore.objects.filter(worker=late).delete()  # as if that seat's offer was never made
    # Past the round, before the next may begin: placed at once on the scores there are.
    ClusterJob.objects.filter(pk=cluster.pk).update(offered_at=round_began - timedelta(seconds=90))
    Worker.objects.filter(pk=late.pk).update(channel_name="live")
    result = run_pass()
    assert result.claimed == [cluster.pk] and not asked_late()


def test_a_seat_that_came_free_is_not_asked_when_the_placement_is_scored_without_it():
    """Asking again costs a statement on the pass's path and a pair per seat: only the seats
    a placement would use unscored are asked, not every seat that came free since."""
    first = idle_workers(1, kinds=("build",))[0]
    cluster = cluster_of_builds(1)
    run_pass()
    answer(first, cluster, 10)
    late = idle_workers(1, kinds=("build",))[0]
    # In the round still: its placement has every seat scored, so it is claimed at once.
    assert run_pass().claimed == [cluster.pk]
    assert DispatchedJob.objects.get().worker_id == first.pk
    assert not JobScore.objects.filter(worker=late, job_id__in=keys(cluster)).exists()


def past_its_round(cluster):
    ClusterJob.objects.filter(pk=cluster.pk).update(
        offered_at=ClusterJob.objects.get(pk=cluster.pk).offered_at - timedelta(seconds=121)
    )


def test_a_placement_that_would_use_a_seat_never_scored_begins_a_new_round():
    first = idle_workers(1, kinds=("build",))[0]
    cluster = cluster_of_builds(1)
    run_pass()
    answer(first, cluster, 10)
    past_its_round(cluster)
    IdleSlot.objects.filter(worker=first).delete()  # the seat that scored it went busy
    late = idle_workers(1, kinds=("build",))[0]
    assert run_pass().claimed == []  # a new round: the late seat is asked and waited for
    assert ClusterJob.objects.get(pk=cluster.pk).offered_at > timezone.now() - timedelta(seconds=5)
    assert JobScore.objects.filter(worker=late, job_id__in=keys(cluster)).count() == 1


def test_a_placement_on_scored_seats_after_its_round_is_not_held_again():
    first = idle_workers(1, kinds=("build",))[0]
    cluster = cluster_of_builds(1)
    run_pass()
    answer(first, cluster, 10)
    past_its_round(cluster)
    late = idle_workers(1, kinds=("build",))[0]  # came free since, never scored it
    assert run_pass().claimed == [cluster.pk]
    assert seated(cluster) == {first.pk}
    assert not JobScore.objects.filter(worker=late, job_id__in=keys(cluster)).exists()


def test_a_new_cluster_is_asked_at_once_even_before_it_can_be_placed():
    """Its scores are in by the time its last seat comes free, so that seat's idle slot
    places it in one pass."""
    early = idle_workers(1, kinds=("build",))[0]
    cluster = cluster_of_builds(2)
    assert run_pass().claimed == []  # one seat of two: no placement yet, but asked
    assert JobScore.objects.filter(worker=early, job_id__in=keys(cluster)).count() == 2
    answer(early, cluster, 10)
    last = idle_workers(1, kinds=("build",))[0]
    answer(last, cluster, 20)  # as its RequestJob's offer of its head had it answered
    past_its_round(cluster)
    assert run_pass().claimed == [cluster.pk]


def test_the_new_clusters_of_the_head_are_offered_in_one_statement(settings):

    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 4}
    workers = idle_workers(3, kinds=("build",))
    inbox = Inbox(workers)
    clusters = [cluster_of_builds(1) for _ in range(5)]
    with CaptureQueriesContext(connection) as queries:
        run_pass()
    offers = [q for q in queries.captured_queries if "WITH unasked AS" in q["sql"]]
    assert len(offers) == 1
    # The window's four, each to every seat, none beyond it.
    head = {k for c in clusters[:4] for k in keys(c)}
    for worker in workers:
        [offer] = inbox.frames(worker)
        assert {j["job_id"] for j in offer["jobs"]} == head
    asked = ClusterJob.objects.filter(offered_at__isnull=False).values_list("pk", flat=True)
    assert sorted(asked) == sorted(c.pk for c in clusters[:4])


def test_a_pass_runs_offer_statements_for_a_window_of_clusters_however_many_ask_in_vain(settings):
    """Seats offered a cluster before and silent since are not asked again: a placement that
    would use them asks in vain. Each such ask is a statement, so it counts against the head."""

    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 2}
    workers = idle_workers(3, kinds=("build",))
    clusters = [cluster_of_builds(1) for _ in range(8)]
    long_ago = timezone.now() - timedelta(seconds=121)  # past a round and the next's start
    for cluster in clusters:
        for worker in workers:  # offered, never answered
            JobScore.objects.create(worker=worker, job_id=keys(cluster)[0], offered_at=long_ago)
    ClusterJob.objects.update(offered_at=long_ago)
    with CaptureQueriesContext(connection) as queries:
        result = run_pass()
    offers = [q for q in queries.captured_queries if "WITH unasked AS" in q["sql"]]
    assert len(offers) == 2  # the window: two build members
    assert len(result.claimed) == 3  # every seat taken, by the clusters first in line


def test_the_unanswered_offers_are_read_per_member_whatever_the_idle_fleet(analyzed):
    """A pass reads which members wait for an idle seat's answer once per member, even under
    the generic plan PostgreSQL keeps for a prepared statement: with the idle workers as a
    second array in the index's condition, it probed the index once per (member, worker)."""

    workers = idle_workers(60, kinds=("build",))
    asked = [cluster_of_builds(2) for _ in range(3)]
    run_pass()  # each member offered to a window of the idle seats, none answered
    answered = cluster_of_builds(1)
    ClusterJob.objects.filter(pk=answered.pk).update(offered_at=timezone.now())
    for worker in workers[:5]:
        answer(worker, answered, 10)
    now = timezone.now()
    ready = startable_clusters(now)
    workers_seen = snapshot(ready, now).workers

    def probes() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT idx_scan FROM pg_stat_xact_user_tables WHERE relname = 'job_score'"
            )
            return cursor.fetchone()[0]

    analyzed()
    with transaction.atomic(), connection.cursor() as cursor:
        # The plan PostgreSQL keeps for a prepared statement, over a job_score as large as
        # a busy fleet's (where the indexes, not a scan of the table, are the way in).
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("SET LOCAL enable_seqscan = off")
        for _ in range(5):  # the statement is prepared on its fifth run (prepare_threshold)
            Asking(ready, workers_seen, now)
        before = probes()
        asking = Asking(ready, workers_seen, now)
        assert asking.unanswered == {k for cluster in asked for k in keys(cluster)}
        assert probes() - before <= 7  # the members read, not 7 x 60


def test_a_seat_silent_on_an_earlier_ask_is_not_asked_a_new_cluster():
    """An idle worker that has not answered the last offer it was asked is left out of a new
    cluster's first ask: on a loaded server its answers queue behind that offer past the
    score wait, so another ask adds to the queue without reaching the pass in time."""
    silent, cheap, dear = idle_workers(3, kinds=("build",))
    first = cluster_of_builds(1)
    run_pass()
    answer(cheap, first, 10)
    answer(dear, first, 20)
    second = cluster_of_builds(1)
    run_pass()  # the first is held for the silent seat's answer, the second asked
    asked = set(JobScore.objects.filter(job_id=keys(second)[0]).values_list("worker", flat=True))
    assert asked == {cheap.pk, dear.pk}

    answer(silent, first, 5)
    third = cluster_of_builds(1)
    run_pass()
    asked = set(JobScore.objects.filter(job_id=keys(third)[0]).values_list("worker", flat=True))
    assert silent.pk in asked  # answered since: asked again
