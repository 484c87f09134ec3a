"""Retention pass: 100,000 finished cluster jobs past the cutoff beside active and young ones.

The method is in docs/benchmarks.md, "Retention pass".
"""

import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

FINISHED, ACTIVE, YOUNG, YOUNG_GONE = 100_000, 100, 10_000, 1_000
DELETED = FINISHED + YOUNG_GONE
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_retention"

# One statement per group of clusters: the clusters, each with an attempt (open or finished)
# and its dispatched_job row, and an evaluation member but for every `memberless`-th cluster
# (0: none memberless, 1: all), whose row then names no evaluation, as after garbage collection.
GROUP_SQL = """
WITH c AS (
    INSERT INTO cluster_job (project_id, status, same_zone, attempts, retry_budget,
                             created_at, updated_at)
    SELECT %(project)s, (%(statuses)s::text[])[1 + i %% cardinality(%(statuses)s::text[])],
           false, 1, 0, %(at)s, %(at)s
    FROM generate_series(1, %(n)s) i
    RETURNING id
), picked AS (
    SELECT id AS cluster_id, gen_random_uuid() AS attempt_id,
           CASE WHEN %(memberless)s = 0 OR id %% %(memberless)s <> 0
                THEN gen_random_uuid() END AS eval_id,
           CASE WHEN %(open)s THEN NULL ELSE %(at)s END AS finished_at
    FROM c
), e AS (
    INSERT INTO evaluation (id, project_id, architecture, required_features, paths,
                            prioritized, created_at, updated_at, status)
    SELECT eval_id, %(project)s, 'x86_64-linux', '{}', '{}', false, %(at)s, %(at)s, 'Completed'
    FROM picked WHERE eval_id IS NOT NULL
), m AS (
    INSERT INTO cluster_member (cluster_job_id, evaluation_id, role, "primary")
    SELECT cluster_id, eval_id, 'server', true FROM picked WHERE eval_id IS NOT NULL
), a AS (
    INSERT INTO cluster_attempt (id, cluster_job_id, created_at, started_at, finished_at, outcome)
    SELECT attempt_id, cluster_id, %(at)s, %(at)s, finished_at,
           CASE WHEN finished_at IS NULL THEN NULL ELSE 'Succeeded' END
    FROM picked
)
INSERT INTO dispatched_job (id, kind, job_id, steps, dispatched_at, finished_at, outcome,
                            cluster_attempt_id, worker_id, evaluation_id, project_id)
SELECT gen_random_uuid(), 'eval', 'eval:' || coalesce(eval_id, gen_random_uuid()), '{}', %(at)s,
       finished_at, CASE WHEN finished_at IS NULL THEN NULL ELSE 'Completed' END,
       attempt_id, %(worker)s, eval_id, %(project)s
FROM picked
"""


def populate(cursor, old, young) -> None:
    """The groups of the module's docstring, `old` past the cutoff and `young` not, under a
    project and worker of their own, oldest first (as ids grow in production)."""
    from gradient.jobs.models import Project

    name = f"retention-{uuid.uuid4()}"
    project = Project.objects.create(name=name).pk
    worker = common.make_workers([name])[0].pk
    finished = ["Completed", "Failed", "Aborted"]
    groups = [
        (FINISHED, finished, old, 10, False),
        (ACTIVE // 2, ["Queued"], old, 0, False),
        (ACTIVE - ACTIVE // 2, ["Running"], old, 0, True),
        (YOUNG, finished, young, 0, False),
        (YOUNG_GONE, finished, young, 1, False),
    ]
    for n, statuses, at, memberless, is_open in groups:
        group = {"n": n, "statuses": statuses, "at": at, "memberless": memberless, "open": is_open}
        cursor.execute(GROUP_SQL, {"project": project, "worker": worker, **group})
    common.analyze()


def main() -> None:
    parser = common.parser(__doc__, DATABASE_URL)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    common.start(args)
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from clusters.retention import run_retention

    days = settings.GRADIENT["RETENTION_DAYS"]
    times = []
    for _ in range(args.repeat):
        now = timezone.now()
        common.ensure_database()
        with connection.cursor() as cursor:
            populate(cursor, now - timedelta(days=days + 1), now)
        began = time.perf_counter()
        deleted = run_retention()
        times.append(time.perf_counter() - began)
        assert deleted == DELETED, deleted
    row = [
        f"{DELETED:,}",
        f"{ACTIVE + YOUNG:,}",
        len(times),
        f"{statistics.median(times):.2f}",
        f"{min(times):.2f} to {max(times):.2f}",
    ]
    header = "clusters deleted | kept | runs | median s | range s"
    common.finish(args, "retention", "## Retention pass", common.table(header, [row]))


if __name__ == "__main__":
    main()
