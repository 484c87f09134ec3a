"""What a pass reads once a run, the dispatch pass's cluster book and the recovery pass's open
attempts, is the live clusters' own rows, not the history kept behind them."""

import pytest
from django.utils import timezone

from clusters import recovery
from clusters.book import startable_clusters
from clusters.models import ClusterAttempt, ClusterJob
from tests.factories import ProjectFactory
from tests.plans import clusters_with_history, rows_read

pytestmark = pytest.mark.django_db

QUEUED, FINISHED = 300, 3000  # also the Running ones, for the recovery pass
HISTORY = ("cluster_attempt", "cluster_member", "evaluation", "derivation_build")


def test_the_book_reads_no_history_however_much_is_kept(analyzed):
    """300 clusters queued and 3,000 finished, each of two evaluations and a build: joined
    flat, PostgreSQL hash-joined every attempt, member and job row for the book, so a pass
    cost more the longer the history kept."""
    project, now = ProjectFactory(), timezone.now()
    clusters = clusters_with_history(project, QUEUED, FINISHED)
    ClusterAttempt.objects.bulk_create(
        ClusterAttempt(cluster_job=c, created_at=now, finished_at=now, outcome="Succeeded")
        for c in clusters[QUEUED:]
    )
    analyzed()

    book = startable_clusters()
    assert sorted(c.id for c in book) == sorted(c.id for c in clusters[:QUEUED])
    assert all(len(c.members) == 3 for c in book)
    # Each statement: at most a probe of each table per member of a queued cluster.
    for statement in (0, 1):
        read = rows_read(startable_clusters, HISTORY, statement)
        assert all(rows <= 3 * QUEUED for rows in read.values()), (statement, read)


def test_the_recovery_pass_reads_no_history_however_much_is_kept(analyzed):
    """300 clusters running and 3,000 finished: joined flat, PostgreSQL hash-joined every
    member of the history to find the open attempts' members."""
    project, now = ProjectFactory(), timezone.now()
    clusters = clusters_with_history(project, QUEUED, FINISHED)
    ClusterJob.objects.filter(pk__in=[c.pk for c in clusters[:QUEUED]]).update(status="Running")
    ClusterAttempt.objects.bulk_create(
        [ClusterAttempt(cluster_job=c, created_at=now, started_at=now) for c in clusters[:QUEUED]]
        + [
            ClusterAttempt(
                cluster_job=c, created_at=now, started_at=now, finished_at=now, outcome="Succeeded"
            )
            for c in clusters[QUEUED:]
        ]
    )
    analyzed()

    def resolve():
        assert recovery.resolve_orphaned_attempts(now) == []  # no member dead, none seated

    read = rows_read(resolve, HISTORY, statement=0)
    assert all(rows <= 3 * QUEUED for rows in read.values()), read
