"""What one (worker, job) pair of the offers costs at least, part by part, on this machine with
nothing else running; and what the throughput target asks of the pairs.

    .venv/bin/python bench/pairs.py [--workers 400] [--jobs 800] [--answer 250] [--repeat 400]
                                    [--write docs/benchmarks.md]

Every job a worker could take is offered to it once and scored by it (protocol.md: a JobOffer
before a RequestJob is answered whenever there are jobs the worker was not offered yet). Parts
measured, each alone, as CPU time (this process's, and its PostgreSQL backend's from /proc):

1. the offer read: a marked read (workers.offers.new_offers) meeting --answer new jobs, which
   PostgreSQL renders as the JobOffer's JSON;
2. the reference worker's answer (workers.simulator): the JobOffer frame parsed, each job
   scored, the JobScores framed;
3. the session reading that answer (workers.protocol.parse_inbound, one score per job);
4. storing it (workers.offers.record_scores, one statement) into a job_score of --workers x
   --jobs rows with its production indexes, each answer from another worker;
5. pruning (workers.pruning.prune_scores): deleting the rows of the jobs once they finished.

It uses its own database (--database, default gradient_pairs; created and migrated when
missing, emptied at the start).
"""

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_pairs"
SECTION = "## Offer pairs"
TARGET_MEMBER_STARTS = 200  # per second at 500 workers (docs/benchmarks.md, throughput)
CORES = os.cpu_count() or 1
WARMUP = 10  # untimed rounds of each part


def backend_cpu() -> float:
    """CPU seconds of this connection's PostgreSQL backend so far."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return common.cpu_secs(cursor.fetchone()[0], children=False)


class Meter:
    """CPU seconds of this process (all threads) and of the backend over a block."""

    def __enter__(self):
        self.here, self.there = time.process_time(), backend_cpu()
        return self

    def __exit__(self, *exc):
        self.here = time.process_time() - self.here
        self.there = backend_cpu() - self.there


def xmin() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text")
        return cursor.fetchone()[0]


def populate(workers: int, jobs: int, answer: int):
    """Workers, --jobs queued jobs every worker has scored, then --answer new queued jobs
    (half evaluations, half builds) nobody was offered; the mark from before the new ones."""
    from django.db import connection

    from gradient.jobs.models import Project
    from gradient.jobs.submission import JobSpec, create_jobs
    from workers.models import Worker, hash_token

    project = Project.objects.create(name="pairs")
    rows = Worker.objects.bulk_create(
        Worker(
            name=f"pairs-{i}",
            token_hash=hash_token(f"pairs-{i}"),
            architectures=["x86_64-linux"],
            max_concurrent_builds=1,
            max_concurrent_evals=1,
            can_eval=True,
            can_build=True,
        )
        for i in range(workers)
    )
    kinds = ("eval", "build")
    create_jobs(project, [JobSpec(kind=kinds[i % 2]) for i in range(jobs)])
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO job_score (worker_id, job_id, offered_at, missing_count,
                                   missing_nar_size, scored_at)
            SELECT w.id, j.key, now(), 0, 0, now()
            FROM worker w
            CROSS JOIN (SELECT 'eval:' || id::text AS key FROM evaluation
                        UNION ALL SELECT 'build:' || id::text FROM derivation_build) j
            """
        )
        cursor.execute("VACUUM ANALYZE job_score")
        cursor.execute("ANALYZE evaluation")
        cursor.execute("ANALYZE derivation_build")
    mark = xmin()
    create_jobs(project, [JobSpec(kind=kinds[i % 2]) for i in range(answer)])
    return rows, mark


def measure(args) -> dict:
    from django.db import connection

    from gradient import heap
    from gradient.jobs.models import BuildStatus, EvaluationStatus
    from workers import protocol as p
    from workers.offers import OfferMark, new_offers, record_scores
    from workers.pruning import prune_scores
    from workers.simulator import SimulatedWorker

    common.ensure_database()
    workers, mark = populate(args.workers, args.jobs, args.answer)
    heap.settle()  # as the daphnes and the fleets are
    # Untimed first: psycopg prepares a statement on its fifth run (docs/design.md), and the
    # first runs fill the caches. The warm-up's stores use workers the timed ones do not.
    spare = workers[-WARMUP:]
    workers = workers[:-WARMUP]
    repeat = min(args.repeat, len(workers))
    parts = {}
    for worker in spare:
        warm = new_offers(worker.pk, worker, OfferMark(xmin=mark, full_read_at=1e18))
        sim_scores = [SimulatedWorker("warm", "unused").score(j) for j in warm.jobs]
        record_scores(worker.pk, p.parse_inbound(p.JobScores(scores=sim_scores).frame()).scores)

    # 1. The offer read, by each worker in turn from the same mark: the new jobs each time.
    offers = []
    with Meter() as m:
        for worker in workers[:repeat]:
            offers.append(new_offers(worker.pk, worker, OfferMark(xmin=mark, full_read_at=1e18)))
    pairs = sum(len(o.jobs) for o in offers if o is not None)
    assert pairs == repeat * args.answer, (pairs, repeat * args.answer)
    parts["offer read"] = m
    frame = offers[0].frame()

    # 2. The reference worker's answer to that frame (no socket: parse, score, frame).
    sim = SimulatedWorker("pairs-sim", "unused")
    with Meter() as m:
        answers = [
            p.JobScores(scores=[sim.score(job) for job in p.parse_outbound(frame).jobs]).frame()
            for _ in range(repeat)
        ]
    parts["reference worker: parse the JobOffer, score, frame the JobScores"] = m

    # 3. The session's reading of it, as on_JobScores does before storing.
    with Meter() as m:
        for text in answers:
            scores = p.parse_inbound(text).scores
            latest = list({s.job_id: s for s in scores}.values())
    parts["session: parse the JobScores"] = m

    # 4. Storing each answer for another worker.
    with Meter() as m:
        for worker in workers[:repeat]:
            record_scores(worker.pk, latest)
    parts["store the scores (job_score)"] = m

    # 5. The jobs finish; the pruning pass deletes their rows.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE evaluation SET status = %s WHERE status = %s",
            [EvaluationStatus.COMPLETED, EvaluationStatus.QUEUED],
        )
        cursor.execute(
            "UPDATE derivation_build SET status = %s WHERE status = %s",
            [BuildStatus.COMPLETED, BuildStatus.QUEUED],
        )
    with Meter() as m:
        deleted = prune_scores()
    rows = args.workers * args.jobs + (repeat + WARMUP) * args.answer
    assert deleted == rows, (deleted, rows)
    parts["prune them once their jobs finished"] = m
    counts = {name: pairs for name in parts} | {"prune them once their jobs finished": deleted}
    return {"parts": parts, "counts": counts, "repeat": repeat}


def us(seconds: float, count: int) -> float:
    return 1e6 * seconds / count


HEADER = ["part", "pairs", "µs per pair: here", "µs per pair: PostgreSQL", "µs per pair"]


def rows(result: dict) -> tuple[list[list], float]:
    out, total = [], 0.0
    for name, m in result["parts"].items():
        n = result["counts"][name]
        here, there = us(m.here, n), us(m.there, n)
        total += here + there
        out.append([name, f"{n:,}", f"{here:.1f}", f"{there:.1f}", f"{here + there:.1f}"])
    out.append(["all", "", "", "", f"**{total:.1f}**"])
    return out, total


def section(command: str, result: dict, total_us: float, args) -> str:
    per_start = args.cluster_workers
    needed = TARGET_MEMBER_STARTS * per_start
    cores_needed = needed * total_us / 1e6
    return (
        f"{SECTION}\n\n"
        "Every job a worker could take is offered to it once and scored by it (protocol.md: a"
        " JobOffer before a RequestJob is answered whenever there are jobs the worker was not"
        " offered yet); the server keeps each answer, which the dispatch pass and the single"
        " path read (a pair never scored counts as the most expensive seat). What one such"
        " (worker, job) pair costs at least, part by part, each measured alone on a quiet"
        " machine as CPU time: this process's (the server's or the reference worker's Python),"
        " and its PostgreSQL backend's (from `/proc`). The job_score table holds"
        f" {args.workers:,} workers x {args.jobs:,} jobs' scores, with its production indexes;"
        f" each offer meets {args.answer} new jobs (half evaluations, half builds, without"
        " paths: the cheapest to score), read by each of"
        f" {result['repeat']} workers from the same mark and answered by each. Not counted:"
        " the WebSocket frames both ways, vacuuming the deleted rows."
        " With the queue kept full (the throughput benchmark) a job waits longer than the 10 s"
        " within which every worker asks again, so each queued member is offered to every"
        f" worker that may take it: at 500 workers the {per_start} of the clusters' project."
        f" {TARGET_MEMBER_STARTS} member starts a second then mean"
        f" {needed:,} pairs a second, which at {total_us:.1f} µs each need"
        f" {cores_needed:.1f} cores for the pairs alone, before any start's own work;"
        f" this machine has {CORES}.\n\n"
        f"- Command: `{command}`\n- Date: {common.now_line()}\n"
        f"- Machine: {common.machine()} on the same host over TCP, shared with other work"
        f" (load average {common.load()})\n\n" + common.table(HEADER, rows(result)[0]) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default=DATABASE_URL)
    parser.add_argument("--workers", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=800, help="jobs scored by every worker")
    parser.add_argument("--answer", type=int, default=250, help="new jobs in each offer")
    parser.add_argument("--repeat", type=int, default=400, help="offers read and answered")
    parser.add_argument(
        "--cluster-workers",
        type=int,
        default=400,
        help="workers each member job is offered to (the throughput benchmark's at 500)",
    )
    parser.add_argument("--write", type=Path, help="update the section in this markdown file")
    args = parser.parse_args()
    if args.answer > 2 * 200 or min(args.jobs, args.answer, args.repeat) < 1:
        parser.error("--answer must be 1 to 400 (an offer holds up to 200 of each kind)")
    if args.workers <= WARMUP:
        parser.error(f"--workers must be more than {WARMUP}")
    command = shlex.join([".venv/bin/python", "bench/pairs.py", *sys.argv[1:]])
    common.setup(args.database, 9)
    print(command, flush=True)
    result = measure(args)
    table, total = rows(result)
    print(common.table(HEADER, table), flush=True)
    if args.write:
        common.write_section(args.write, SECTION, section(command, result, total, args))


if __name__ == "__main__":
    main()
