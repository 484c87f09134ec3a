"""The dispatch pass on its threads: the cheapest scores are read on one thread and the claims
made on others while the planner seats clusters on the calling one. It must place and claim
exactly what the planner alone places."""

import random

import pytest
from django.utils import timezone

from clusters import planner, statements
from clusters.book import startable_clusters
from clusters.dispatch import CLAIM_BATCH, run_pass, snapshot
from clusters.models import ClusterAttempt
from clusters.scores import SCORE_CHUNK, CheapestScores
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import Inbox, idle_workers
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory
from workers.models import JobScore

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


def many_clusters(count: int) -> list:
    clusters = []
    for _ in range(count):
        cluster = ClusterFactory()
        EvalMemberFactory(cluster_job=cluster, role="server")
        BuildMemberFactory(cluster_job=cluster, role="client")
        clusters.append(cluster)
    return clusters


def score_everything(workers, clusters, seed=3):
    """A score for most (worker, member) pairs, all sizes distinct: one cheapest seating."""
    rng = random.Random(seed)
    now = timezone.now()
    sizes = rng.sample(range(1, 10**9), len(workers) * len(clusters) * 2)
    rows = []
    for cluster in clusters:
        for member in cluster.members.all():
            for worker in workers:
                if rng.random() < 0.8:
                    rows.append(
                        JobScore(
                            worker=worker,
                            job_id=member.job_key,
                            offered_at=now,
                            scored_at=now,
                            missing_nar_size=sizes.pop(),
                        )
                    )
    JobScore.objects.bulk_create(rows)


def test_a_pass_on_its_threads_claims_what_the_planner_alone_places():
    count = CLAIM_BATCH + 20  # two claim batches, and more keys than one chunk of scores
    assert 2 * count > SCORE_CHUNK
    clusters = many_clusters(count)
    workers = idle_workers(2 * count + 10)
    score_everything(workers, clusters)
    inbox = Inbox(workers)
    # The planner alone, every score read up front on this thread.
    now = timezone.now()
    expected = planner.plan(snapshot(startable_clusters(now), now))
    assert len(expected) == count
    result = run_pass()
    assert result.claimed == [p.cluster_id for p in expected]  # in the planner's order
    seated = dict(DispatchedJob.objects.values_list("job_id", "worker_id"))
    assert seated == {s.member.key: s.worker.id for p in expected for s in p.seats}
    assert ClusterAttempt.objects.filter(finished_at__isnull=True).count() == count
    frames = {w.pk: inbox.frames(w) for w in workers}
    assert {w: [f["job_id"] for f in fs] for w, fs in frames.items() if fs} == {
        worker: [key] for key, worker in seated.items()
    }


def test_a_failed_read_of_scores_fails_whoever_waits_for_them(monkeypatch):
    clusters = many_clusters(3)
    workers = idle_workers(6)
    score_everything(workers, clusters)
    keys = [m.job_key for c in clusters for m in c.members.all()]
    monkeypatch.setattr(statements, "CHEAPEST_SCORES_SQL", "SELECT 1 / 0")  # a read that fails
    read = CheapestScores(keys).start()
    with pytest.raises(RuntimeError, match="reading the cheapest scores failed"):
        read.get(keys[0])
    with pytest.raises(RuntimeError):
        assert keys[-1] in read.truncated
    read.finish()  # returns: the reader is done


def test_a_read_of_scores_on_its_thread_gives_what_a_read_in_line_gives():
    clusters = many_clusters(SCORE_CHUNK // 2 + 5)
    workers = idle_workers(20)
    score_everything(workers, clusters)
    keys = [m.job_key for c in clusters for m in c.members.all()]
    in_line = CheapestScores(keys)
    in_line.read()
    threaded = CheapestScores(keys).start()
    for key in reversed(keys):  # the last chunk first: waits for it
        ids, sizes = threaded[key]
        assert ids.tolist() == in_line[key][0].tolist()
        assert sizes.tolist() == in_line[key][1].tolist()
        assert (key in threaded.truncated) == (key in in_line.truncated)
    assert len(threaded) == len(keys)
    threaded.finish()
