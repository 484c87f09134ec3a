"""History kept: /metrics and the admin's lists over 20,000 and 200,000 finished clusters.

The method is in docs/benchmarks.md, "History kept".
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import _common as common

DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_history"
SECTION = "## History kept"
BENCH = "history"
REPEAT = 3
METRICS_TARGET_MS, LIST_TARGET_MS, GROWTH_TARGET = 50, 150, 1.2

PAGES = {
    "GET /metrics": "/metrics",
    "clusters": "/admin/clusters/clusterjob/",
    "cluster attempts": "/admin/clusters/clusterattempt/",
    "dispatched jobs": "/admin/jobs/dispatchedjob/",
    "evaluations": "/admin/jobs/evaluation/",
}

# Clusters numbered (first, last], created evenly over the 30 days before %(now)s, each with
# two evaluation members, a started and Succeeded attempt and a Completed assignment per member.
LOAD_SQL = """
WITH c AS (
    INSERT INTO cluster_job (project_id, status, same_zone, attempts, retry_budget,
                             created_at, updated_at)
    SELECT %(project)s, 'Completed', false, 1, 0,
           %(now)s - interval '30 days' * (1 - i::float / %(last)s),
           %(now)s - interval '30 days' * (1 - i::float / %(last)s) + interval '3 minutes'
    FROM generate_series(%(first)s + 1, %(last)s) i
    RETURNING id, created_at
), a AS (
    INSERT INTO cluster_attempt (id, cluster_job_id, created_at, started_at, finished_at, outcome)
    SELECT gen_random_uuid(), id, created_at + interval '20 seconds',
           created_at + interval '21 seconds', created_at + interval '3 minutes', 'Succeeded'
    FROM c
    RETURNING id, cluster_job_id, created_at, finished_at
), m AS (
    SELECT a.*, gen_random_uuid() AS eval_id, role FROM a, unnest('{server,client}'::text[]) role
), e AS (
    INSERT INTO evaluation (id, project_id, architecture, required_features, paths,
                            prioritized, created_at, updated_at, status)
    SELECT eval_id, %(project)s, 'x86_64-linux', '{}', '{}', false, created_at, finished_at,
           'Completed'
    FROM m
), cm AS (
    INSERT INTO cluster_member (cluster_job_id, evaluation_id, role, "primary")
    SELECT cluster_job_id, eval_id, role, role = 'server' FROM m
)
INSERT INTO dispatched_job (id, kind, job_id, steps, dispatched_at, finished_at, outcome,
                            accepted_at, cluster_attempt_id, worker_id, evaluation_id,
                            project_id)
SELECT gen_random_uuid(), 'eval', 'eval:' || eval_id, '{}', created_at, finished_at,
       'Completed', created_at + interval '1 second', id, %(worker)s, eval_id, %(project)s
FROM m
"""


def load_clusters(first: int, last: int) -> None:
    """Add clusters first+1 .. last, with the vacuum autovacuum would do."""
    from django.db import connection
    from django.utils import timezone

    from gradient.jobs.models import Project
    from workers.models import Worker

    project, _ = Project.objects.get_or_create(name="history")
    worker = Worker.objects.filter(name="history").first() or Worker.objects.create(
        name="history", token_hash="history"
    )
    with connection.cursor() as cursor:
        # The rows are whole and consistent: no trigger or foreign-key check to run per row.
        cursor.execute("SET session_replication_role = replica")
        ids = {"project": project.pk, "worker": worker.pk}
        cursor.execute(LOAD_SQL, {**ids, "first": first, "last": last, "now": timezone.now()})
        cursor.execute("SET session_replication_role = DEFAULT")
    common.analyze(vacuum=True)


def server_ms(client, url: str) -> float:
    """Best of REPEAT, in ms, after one untimed request."""
    times = []
    for i in range(REPEAT + 1):
        began = time.perf_counter()
        response = client.get(url, HTTP_HOST="localhost")
        took = time.perf_counter() - began
        assert response.status_code == 200, (url, response.status_code)
        if i:
            times.append(took * 1000)
    return min(times)


def measure(client) -> dict:
    """Each page's best time, and how long folding the new clusters into the tally took."""
    from gradient.metrics import fold

    began = time.perf_counter()
    while fold():  # the backlog, as successive scrapes fold it
        pass
    first = time.perf_counter() - began
    common.analyze(vacuum=True)  # as autovacuum does after that many updates
    return {"first": first, "times": {name: server_ms(client, url) for name, url in PAGES.items()}}


def main() -> None:
    parser = common.parser(__doc__, database=DATABASE_URL, redis_db=5)
    parser.add_argument("--sizes", default="20000,200000", help="cluster counts, ascending")
    args = parser.parse_args()
    sizes = common.parse_ints(args.sizes)
    common.start(args)
    common.ensure_database()
    from django.contrib.auth import get_user_model
    from django.test import Client

    users = get_user_model().objects
    user = users.filter(username="history").first() or users.create_superuser(
        "history", "history@example.com", "x"
    )
    client = Client()
    client.force_login(user)
    results, loaded = {}, 0
    for size in sizes:
        load_clusters(loaded, size)
        loaded = size
        results[size] = measure(client)
    common.finish(args, BENCH, SECTION, text_table(sizes, results), (), figures(sizes, results))


def growth(sizes, results, name) -> float:
    return results[sizes[-1]]["times"][name] / results[sizes[0]]["times"][name]


def text_table(sizes, results) -> str:
    header = ["page", *(f"ms at {s:,}" for s in sizes), "growth"]
    rows = [
        [
            name,
            *(f"{results[s]['times'][name]:.1f}" for s in sizes),
            f"{growth(sizes, results, name):.2f}x",
        ]
        for name in PAGES
    ]
    rows.append(
        [
            "folding the new clusters into the tally, s",
            *(f"{results[s]['first']:.2f}" for s in sizes),
            "-",
        ]
    )
    return common.table(" | ".join(header), rows)


def figures(sizes, results) -> list:
    small, large = sizes[0], sizes[-1]
    out = []
    for name in PAGES:
        target = METRICS_TARGET_MS if name == "GET /metrics" else LIST_TARGET_MS
        ms, g = results[large]["times"][name], growth(sizes, results, name)
        out.append(
            common.Figure(
                f"history: {name}, ms at {large:,} clusters, and over {small:,}",
                f"< {target} ms, ≤ {GROWTH_TARGET}x",
                f"{ms:.1f} ms, {g:.2f}x",
                ms < target and g <= GROWTH_TARGET,
            )
        )
    return out


if __name__ == "__main__":
    main()
