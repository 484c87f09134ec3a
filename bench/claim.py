"""Claim latency: claim_cluster against a floor that writes the same rows with raw psycopg,
and the dispatch pass's batched claim (claim_clusters) per cluster.

    .venv/bin/python bench/claim.py [--repeat N] [--write docs/benchmarks.md]

Every repetition gets a fresh Queued cluster of half evaluation and half build members, each
with its own fresh worker (untimed setup); only the call itself is timed. The floor writes the
same rows (the attempt, one dispatched_job per member, the Queued->Building move of the builds)
under the same conditions in one transaction on its own connection, batched into one
statement, and commits only when every row was written. The batch claims BATCH such clusters
in one call; its time is divided by BATCH.

It uses its own database (DATABASE_URL, default gradient_bench): created and migrated when
missing, and emptied at the start of every run.
"""
# ruff: noqa: E402

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gradient_bench")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

import django
import psycopg
from psycopg import sql

django.setup()

from django.conf import settings
from django.core.management import call_command
from django.db import connection

from bench import _common as common
from clusters.claim import ClusterClaim, claim_cluster, claim_clusters
from clusters.models import ClusterJob, ClusterMember, ClusterStatus
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import (
    EVALUATION_STARTABLE,
    BuildStatus,
    DerivationBuild,
    Evaluation,
    JobKind,
    Project,
)
from workers.models import Worker

SIZES = (2, 8, 32, 128)
WARMUP = 5
BATCH = 16  # clusters per claim_clusters call
SECTION = "## Claim latency"
BENCH = "claim"  # its name in bench/run, which its summary rows carry
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


def ensure_database() -> None:
    name = connection.settings_dict["NAME"]
    with psycopg.connect(os.environ["DATABASE_URL"], dbname="postgres", autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:  # every run starts from the same empty tables
        cursor.execute(
            "TRUNCATE dispatched_job, cluster_attempt, cluster_member, cluster_job,"
            " evaluation, derivation_build, worker, project CASCADE"
        )


def make_claim(project: Project, size: int) -> ClusterClaim:
    """A fresh Queued cluster of size // 2 evaluations and the rest builds, one worker each."""
    cluster = ClusterJob.objects.create(project=project)
    evals = Evaluation.objects.bulk_create(Evaluation(project=project) for _ in range(size // 2))
    builds = DerivationBuild.objects.bulk_create(
        DerivationBuild(project=project, status=BuildStatus.QUEUED) for _ in range(size - size // 2)
    )
    ClusterMember.objects.bulk_create(
        [ClusterMember(cluster_job=cluster, evaluation=e, role="eval") for e in evals]
        + [ClusterMember(cluster_job=cluster, derivation_build=b, role="build") for b in builds]
    )
    workers = Worker.objects.bulk_create(
        Worker(name=f"bench-{uuid.uuid4()}", token_hash=uuid.uuid4().hex) for _ in range(size)
    )
    gates = [ClaimGate(JobKind.EVAL, e.pk) for e in evals]
    gates += [ClaimGate(JobKind.BUILD, b.pk) for b in builds]
    members = [Assignment(g, w.pk, project.pk) for g, w in zip(gates, workers, strict=True)]
    return ClusterClaim(cluster_id=cluster.pk, members=members)


def floor(conn: psycopg.Connection, claim: ClusterClaim) -> bool:
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


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1]


def batch_times(project: Project, size: int, runs: int) -> list[float]:
    """claim_clusters of BATCH fresh clusters, ms per cluster, for each of `runs` calls."""
    times = []
    for i in range(WARMUP + runs):
        claims = [make_claim(project, size) for _ in range(BATCH)]
        per_cluster = timed(lambda cs: all(claim_clusters(cs)), claims) / BATCH
        if i >= WARMUP:
            times.append(per_cluster)
    return times


def run(repeat: int) -> list[dict]:
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
                    "claim": (statistics.median(claims), p95(claims)),
                    "floor": (statistics.median(floors), p95(floors)),
                    "ratio": statistics.median(claims) / statistics.median(floors),
                    "batch": (statistics.median(batches), p95(batches), len(batches)),
                }
            )
            print(table_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| members | runs | claim median ms | claim p95 ms | floor median ms | floor p95 ms"
    " | claim/floor | batch runs | batch median ms/cluster | batch p95 ms/cluster | batch/floor |"
    "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: dict) -> str:
    (cm, cp), (fm, fp), (bm, bp, bn) = r["claim"], r["floor"], r["batch"]
    return (
        f"| {r['size']} | {r['runs']} | {cm:.2f} | {cp:.2f} | {fm:.2f} | {fp:.2f}"
        f" | {r['ratio']:.2f}x | {bn} | {bm:.2f} | {bp:.2f} | {bm / fm:.2f}x |"
    )


LEAD = (
    "`claim_cluster`, the wall time of one call, against a floor that writes the same rows, and"
    " the dispatch pass's batched claim per cluster (see `bench/claim.py`)."
)


def method() -> list[str]:
    return [
        "Workload: for every run a fresh Queued cluster, half evaluation and half build members,"
        f" each member on a fresh worker of its own; only the call is timed, after {WARMUP}"
        " untimed warm-up runs per size.",
        "Floor: the same rows (the attempt, a dispatched_job per member, the builds' move to"
        " Building) in one raw psycopg transaction of one statement, on a connection of its own."
        " Claim and floor runs alternate, so a change of load hits both alike.",
        f"Batch: `claim_clusters`, the pass's claim, over {BATCH} such clusters in one call (one"
        f" transaction, each claim winning or losing alone), divided by {BATCH}: one cluster's"
        " claim in a pass, without its seats.",
        "A row: one cluster size; medians and p95s in ms; claim/floor and batch/floor compare"
        " medians. The ratio moves from run to run, most at 128 members: over four runs on a"
        " quiet machine, 0.83x to 1.12x at 8 members and 0.65x to 1.52x at 128.",
        f"Target (issues 3 and 19): within {TARGET_RATIO:g}x of the floor at {TARGET_SIZE}"
        " members.",
    ]


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


def section(command: str, rows: list[dict], load: str) -> str:
    body = "\n".join([HEADER, *map(table_row, rows)])
    return common.section_text(SECTION, LEAD, method(), common.run_facts(command, load), body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="runs per size (a quarter at 128)")
    parser.add_argument("--write", type=Path, help="update the section in this markdown file")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/claim.py", *sys.argv[1:]])
    ensure_database()
    print(f"{command}\n\n{HEADER}", flush=True)
    before = common.load()
    rows = run(args.repeat)
    if args.write:
        load = f"{before} at the start, {common.load()} at the end"
        common.write_section(
            args.write, SECTION, section(command, rows, load), BENCH, figures(rows)
        )


if __name__ == "__main__":
    main()
