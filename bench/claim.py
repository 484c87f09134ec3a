"""Claim latency: claim_cluster against a floor that writes the same rows with raw psycopg,
and the dispatch pass's batched claim (claim_clusters) per cluster.

The method is in docs/benchmarks.md, "Claim latency".
"""

import gc
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

SIZES = (2, 8, 32, 128)
WARMUP = 5
BATCH = 16  # clusters per claim_clusters call
TARGET_SIZE, TARGET_RATIO = 8, 2.0  # claim within 2x of the floor at 8 members

FLOOR_SQL = """
WITH attempt AS (
    INSERT INTO cluster_attempt (id, cluster_job_id, created_at)
    SELECT %(attempt)s, %(cluster)s, %(now)s
    WHERE EXISTS (SELECT 1 FROM cluster_job WHERE id = %(cluster)s AND status = %(queued)s
                  FOR SHARE)
    ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
    RETURNING id
), member AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(kinds)s::text[], %(keys)s::text[],
                         %(evals)s::uuid[], %(builds)s::uuid[], %(workers)s::bigint[],
                         %(substitute)s::boolean[])
        AS m(id, kind, job_id, evaluation_id, derivation_build_id, worker_id, substitute)
), claimed AS (
    INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, derivation_build_id,
                                worker_id, project_id, steps, dispatched_at, cluster_attempt_id)
    SELECT m.id, m.kind, m.job_id, m.evaluation_id, m.derivation_build_id, m.worker_id,
           %(project)s, '{}', %(now)s, a.id
    FROM member m CROSS JOIN attempt a
    WHERE EXISTS (SELECT 1 FROM evaluation e
                  WHERE e.id = m.evaluation_id AND e.status = ANY(%(startable)s))
       OR EXISTS (SELECT 1 FROM derivation_build b WHERE b.id = m.derivation_build_id
                  AND b.status = %(queued)s AND b.cache_available = m.substitute)
    ORDER BY m.job_id
    ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
    RETURNING 1
), assigned AS (
    UPDATE derivation_build SET status = %(building)s
    WHERE id = ANY(%(builds)s::uuid[]) AND status = %(queued)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM attempt), (SELECT count(*) FROM claimed),
       (SELECT count(*) FROM assigned)
"""


def make_claim(project, size: int):
    """A fresh Queued cluster of size // 2 evaluations and the rest builds, one worker each."""
    from clusters.claim import ClusterClaim
    from gradient.jobs.claim import Assignment, ClaimGate
    from gradient.jobs.models import JobKind

    evals = size // 2
    shape = [("eval", "eval", {}, {})] * evals + [("build", "build", {}, {})] * (size - evals)
    (cluster,), jobs = common.make_clusters([({"project": project}, shape)])
    workers = common.make_workers(f"bench-{uuid.uuid4()}" for _ in range(size))
    gates = [
        ClaimGate(JobKind.EVAL if i < evals else JobKind.BUILD, j.pk) for i, j in enumerate(jobs)
    ]
    members = [Assignment(g, w.pk, project.pk) for g, w in zip(gates, workers, strict=True)]
    return ClusterClaim(cluster_id=cluster.pk, members=members)


def floor(conn, claim) -> bool:
    from django.conf import settings

    from clusters.models import ClusterStatus
    from gradient.jobs.models import EVALUATION_STARTABLE, BuildStatus, JobKind

    members = sorted(claim.members, key=lambda m: m.gate.key)
    is_eval = [m.gate.kind == JobKind.EVAL for m in members]
    params = {
        "attempt": claim.attempt_id,
        "cluster": claim.cluster_id,
        "now": claim.now,
        "project": members[0].project_id,
        "ids": [m.id for m in members],
        "kinds": [m.gate.kind for m in members],
        "keys": [m.gate.key for m in members],
        "evals": [m.gate.job if e else None for m, e in zip(members, is_eval, strict=True)],
        "builds": [None if e else m.gate.job for m, e in zip(members, is_eval, strict=True)],
        "workers": [m.worker_id for m in members],
        "substitute": [m.gate.substitute for m in members],
        "startable": sorted(EVALUATION_STARTABLE),
        "queued": ClusterStatus.QUEUED.value,  # also BuildStatus.QUEUED
        "building": BuildStatus.BUILDING.value,
    }
    ms = int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"])
    with conn.pipeline():  # BEGIN, SET and the claim in one round trip, COMMIT in another
        conn.execute(f"SET LOCAL lock_timeout = {ms}")
        counts = conn.execute(FLOOR_SQL, params).fetchone()
        won = counts == (1, len(members), len(members) - sum(is_eval))
        if won:
            conn.commit()
        else:
            conn.rollback()
    return won


def timed(call, claim) -> float:
    gc.disable()
    began = time.perf_counter()
    won = call(claim)
    elapsed = time.perf_counter() - began
    gc.enable()
    assert won, "the benchmark's claim lost"
    return elapsed * 1000


def batch_times(project, size: int, runs: int) -> list[float]:
    """claim_clusters of BATCH fresh clusters, ms per cluster, for each of `runs` calls."""
    from clusters.claim import claim_clusters

    times = []
    for i in range(WARMUP + runs):
        claims = [make_claim(project, size) for _ in range(BATCH)]
        per_cluster = timed(lambda cs: all(claim_clusters(cs)), claims) / BATCH
        if i >= WARMUP:
            times.append(per_cluster)
    return times


def run(repeat: int) -> list[dict]:
    import psycopg

    from clusters.claim import claim_cluster
    from gradient.jobs.models import Project

    project = Project.objects.create(name=f"bench-{uuid.uuid4()}")
    rows = []
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        for size in SIZES:
            runs = repeat if size <= 32 else max(repeat // 4, 20)
            claims, floors = [], []
            for i in range(WARMUP + runs):  # interleaved, so load drift hits both alike
                c = timed(claim_cluster, make_claim(project, size))
                f = timed(lambda cl: floor(conn, cl), make_claim(project, size))
                if i >= WARMUP:
                    claims.append(c)
                    floors.append(f)
            batches = batch_times(project, size, max(runs // 8, 10))
            rows.append(
                {
                    "size": size,
                    "runs": runs,
                    "claim": common.median_p(claims, 95),
                    "floor": common.median_p(floors, 95),
                    "ratio": statistics.median(claims) / statistics.median(floors),
                    "batch": (*common.median_p(batches, 95), len(batches)),
                }
            )
    return rows


HEADER = (
    "members | runs | claim median ms | claim p95 ms | floor median ms | floor p95 ms"
    " | claim/floor | batch runs | batch median ms/cluster | batch p95 ms/cluster | batch/floor"
)


def table_row(r: dict) -> list:
    (cm, cp), (fm, fp), (bm, bp, bn) = r["claim"], r["floor"], r["batch"]
    ms = [f"{x:.2f}" for x in (cm, cp, fm, fp)]
    batch = [bn, f"{bm:.2f}", f"{bp:.2f}", f"{bm / fm:.2f}x"]
    return [r["size"], r["runs"], *ms, f"{r['ratio']:.2f}x", *batch]


def figures(rows: list[dict]) -> list[common.Figure]:
    at = next((r for r in rows if r["size"] == TARGET_SIZE), None)
    if at is None:
        return []
    return [
        common.Figure(
            f"claim / floor at {TARGET_SIZE} members",
            f"≤ {TARGET_RATIO:g}x",
            f"{at['ratio']:.2f}x",
            at["ratio"] <= TARGET_RATIO,
        )
    ]


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--repeat", type=int, default=200, help="runs per size (a quarter at 128)")
    args = parser.parse_args()
    common.start(args)
    common.ensure_database()
    rows = run(args.repeat)
    table = common.table(HEADER, [table_row(r) for r in rows])
    common.finish(args, "claim", "## Claim latency", table, figures=figures(rows))


if __name__ == "__main__":
    main()
