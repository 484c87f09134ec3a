"""Retention pass: 100,000 finished cluster jobs past the cutoff beside active and young ones.

    .venv/bin/python bench/retention.py [--repeat N] [--write docs/benchmarks.md]

Every repetition rebuilds the rows with raw SQL (untimed). Every cluster has one attempt with
a dispatched_job row per member. 100,000 finished clusters past the cutoff, nine in ten with
an evaluation member, the tenth without (evaluation garbage collection took it); 10,000 young
finished ones with members, which stay; 1,000 young finished ones without members, which go
at once; 100 active ones as old as the first (with members; the Running ones with an open
attempt). Only run_retention() is timed, and it must delete exactly the 101,000.

It uses its own database (--database-url, default gradient_bench_retention): created and
migrated when missing, and emptied at the start of every repetition.
"""

import argparse
import os
import shlex
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

FINISHED, ACTIVE, YOUNG, YOUNG_GONE = 100_000, 100, 10_000, 1_000
DELETED = FINISHED + YOUNG_GONE
SECTION = "## Retention pass"
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
    from workers.models import Worker

    name = f"retention-{uuid.uuid4()}"
    project = Project.objects.create(name=name).pk
    worker = Worker.objects.create(name=name, token_hash=uuid.uuid4().hex).pk
    finished = ["Completed", "Failed", "Aborted"]
    groups = [
        (FINISHED, finished, old, 10, False),
        (ACTIVE // 2, ["Queued"], old, 0, False),
        (ACTIVE - ACTIVE // 2, ["Running"], old, 0, True),
        (YOUNG, finished, young, 0, False),
        (YOUNG_GONE, finished, young, 1, False),
    ]
    for n, statuses, at, memberless, is_open in groups:
        cursor.execute(
            GROUP_SQL,
            {
                "project": project,
                "worker": worker,
                "n": n,
                "statuses": statuses,
                "at": at,
                "memberless": memberless,
                "open": is_open,
            },
        )
    cursor.execute(
        "ANALYZE cluster_job, cluster_member, cluster_attempt, dispatched_job, evaluation"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--write", type=Path, help="update the section in this markdown file")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/retention.py", *sys.argv[1:]])

    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    # Never an ambient DATABASE_URL: every repetition empties the database.
    os.environ["DATABASE_URL"] = args.database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    import django

    django.setup()
    import psycopg
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone
    from psycopg import sql

    from clusters.retention import BATCH, run_retention

    name = connection.settings_dict["NAME"]
    with psycopg.connect(args.database_url, dbname="postgres", autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    call_command("migrate", verbosity=0)

    from bench import _common as common

    days = settings.GRADIENT["RETENTION_DAYS"]
    load_before = common.load()
    times = []
    for _ in range(args.repeat):
        now = timezone.now()
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE dispatched_job, cluster_attempt, cluster_member, cluster_job,"
                " evaluation, derivation_build, worker, project CASCADE"
            )
            populate(cursor, now - timedelta(days=days + 1), now)
        began = time.perf_counter()
        deleted = run_retention()
        times.append(time.perf_counter() - began)
        assert deleted == DELETED, deleted
        print(f"deleted {deleted} (batches of {BATCH}) in {times[-1]:.2f} s", flush=True)
    print(f"median {statistics.median(times):.2f} s over {len(times)} runs")
    if args.write:
        load = f"{load_before} at the start, {common.load()} at the end"
        common.write_section(args.write, SECTION, section(command, times, BATCH, load))


def section(command: str, times: list[float], batch: int, load: str) -> str:
    from bench import _common as common

    row = [
        f"{DELETED:,}",
        f"{ACTIVE + YOUNG:,}",
        len(times),
        f"{statistics.median(times):.2f}",
        f"{min(times):.2f} to {max(times):.2f}",
    ]
    lead = (
        "The hourly retention pass, `run_retention()`, over a table of old and young finished"
        " clusters (see `bench/retention.py`)."
    )
    method = [
        f"Deleted: {FINISHED:,} finished clusters past the cutoff (nine in ten with a member;"
        " every one with an attempt and its dispatched_job rows) and"
        f" {YOUNG_GONE:,} young finished ones that evaluation garbage collection left without"
        " members.",
        f"Kept: {YOUNG:,} young finished clusters and {ACTIVE} active ones as old as the first.",
        f"Timed: `run_retention()` alone, in batches of {batch:,}; the rows are rebuilt before"
        " every run. A row: the median and range over the runs.",
    ]
    body = common.table(["clusters deleted", "kept", "runs", "median s", "range s"], [row])
    return common.section_text(SECTION, lead, method, common.run_facts(command, load), body)


if __name__ == "__main__":
    main()
