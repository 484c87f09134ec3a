"""The writers of job_score at once, on real connections: a dispatch pass asking idle seats
(clusters.asking) and a session recording its worker's scores (workers.offers) insert
overlapping (worker, job) pairs; neither may deadlock the other."""

import pytest
from django.db import connection
from django.utils import timezone

from clusters.statements import ASK_SEATS_SQL
from gradient.postgresql.arrays import int_array, text_array
from gradient.wire.protocol import Score
from tests.concurrency import race
from tests.factories import WorkerFactory
from workers import offers
from workers.models import JobScore

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = [f"build:00000000-0000-0000-0000-{i:012d}" for i in range(300)]


def pass_asks(worker_ids, keys):
    pairs = [(w, k) for w in worker_ids for k in keys]
    with connection.cursor() as cursor:
        cursor.execute(
            ASK_SEATS_SQL,
            {
                "now": timezone.now(),
                "workers": int_array(w for w, _ in pairs),
                "keys": text_array([k for _, k in pairs]),
                "turns": int_array(range(len(pairs))),
                "per_member": len(pairs),
            },
        )
        return cursor.fetchall()


def session_scores(worker_id, keys):
    scores = [Score(job_id=k, missing_count=1, missing_nar_size=7) for k in keys]
    return offers.record_scores(worker_id, scores)


def test_a_pass_asking_and_sessions_answering_the_same_pairs_never_deadlock():
    workers = [WorkerFactory().pk for _ in range(2)]
    for _ in range(15):
        JobScore.objects.all().delete()
        # Opposite orders given: each statement must write in the one order of its own.
        race(
            lambda: pass_asks(workers, list(reversed(KEYS))),
            lambda: session_scores(workers[0], KEYS),
            lambda: session_scores(workers[1], KEYS[::2] + KEYS[1::2]),
        )
        scored = JobScore.objects.filter(missing_nar_size=7)
        assert scored.filter(worker_id=workers[0]).count() == len(KEYS)
        assert scored.filter(worker_id=workers[1]).count() == len(KEYS)
