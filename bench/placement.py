"""Placement quality on a deep queue: the bytes the seats the dispatch pass chose must fetch,
against the planner's cheapest seating with every (worker, member job) pair scored on the same
snapshot.

The method is in docs/benchmarks.md, "Placement quality".
"""

import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 14
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_placement"
TARGET = 1.1  # chosen bytes at most this times full scoring's (issue #18)
ZONES = ("a", "b", "c")
PATH_POOL = 3000  # store paths the jobs draw theirs from, so jobs share some
PATHS_PER_JOB = (3, 10)
HAVE = (0.1, 0.7)  # share of the pool a worker's store holds, drawn per worker
EVAL_SHARE = 0.4  # members that are evaluations
SAME_ZONE_SHARE = 1 / 3
BUILD_ONLY_EVERY = 4  # every 4th worker takes builds only
HEARTBEAT_SECS = 10  # a free slot's RequestJob is resent this often (protocol's InitAck)
VACUUM_SECS = 5
JOB_PASSES = (3, 10)  # a claimed cluster runs this many passes
SEED = 18


@dataclass
class Pass:
    """One pass's figures, for the clusters it claimed."""

    chosen: int = 0  # bytes the chosen seats must fetch
    reference: int = 0  # bytes of full scoring's seating of the same clusters
    seats: int = 0
    unscored: int = 0  # seats placed without a score
    placements: int = 0
    unseated: int = 0  # clusters full scoring could not seat (left out of both sums)


@dataclass
class Run:
    depth: int
    workers: int
    passes: list[Pass] = field(default_factory=list)
    ticks: int = 0
    outside: int = 0  # seats on a worker the snapshot did not have
    mismatched: int = 0  # seats whose recorded score was not the scorer's
    load: str = ""
    run: int = 0  # which run of its depth (0: the only one)


class Fleet:
    """The worker rows, each with its store (the share of the pool it holds, as has_path
    decides), its sessions' offers, and its slots: free or seated until a cluster ends."""

    def __init__(self, workers, have: list[float]):
        from workers.offers import Offered

        self.workers = {w.pk: w for w in workers}
        self.have = dict(zip(self.workers, have, strict=True))
        self.offered = {pk: Offered() for pk in self.workers}
        self.asked: dict[tuple[int, str], float] = {}  # free slot -> when it last asked

    def slots(self, worker) -> list[str]:
        return [kind for kind, can in (("eval", worker.can_eval), ("build", True)) if can]

    def cost(self, worker_id: int, paths) -> tuple[int, int]:
        from workers.simulator import missing_cost

        return missing_cost(self.workers[worker_id].name, paths, self.have[worker_id])

    def ask(self, worker_id: int, kinds: list[str]) -> None:
        """The worker's RequestJobs for these free slots, as its session serves them."""
        from sessions import request_job
        from workers import assignment

        worker, offered = self.workers[worker_id], self.offered[worker_id]
        head = request_job.read_head(worker, offered)
        if head.offer is not None:
            self.answer(worker_id, [(job.job_id, job.paths) for job in head.offer.jobs])
        for kind in kinds:
            if assignment.request_job(
                worker_id, kind, worker, head.singles[kind], offered.sizes
            ).assign:
                raise RuntimeError("a single job was assigned, but the bench queues none")
            self.asked[(worker_id, kind)] = time.monotonic()

    def answer(self, worker_id: int, jobs) -> None:
        """A JobScores for these (job key, paths), as the session records it."""
        from gradient.wire.protocol import Score
        from workers import offers

        scores = [
            Score(job_id=key, missing_count=c, missing_nar_size=s)
            for key, paths in jobs
            for c, s in [self.cost(worker_id, paths)]
        ]
        members = self.offered[worker_id].record(scores)
        offers.record_scores(worker_id, members)

    def stale(self) -> dict[int, list[str]]:
        """Free slots whose last RequestJob is a heartbeat old, by worker."""
        due = time.monotonic() - HEARTBEAT_SECS
        out = defaultdict(list)
        for (worker_id, kind), at in self.asked.items():
            if at <= due:
                out[worker_id].append(kind)
        return out


def make_fleet(count: int, rng: random.Random) -> Fleet:
    def build_only(i: int) -> bool:
        return i % BUILD_ONLY_EVERY == BUILD_ONLY_EVERY - 1

    rows = common.make_workers(
        (f"pl-{i}" for i in range(count)),
        connected=True,  # the pass seats only those
        each=lambda i: {
            "max_concurrent_evals": 0 if build_only(i) else 1,
            "can_eval": not build_only(i),
            "zone": ZONES[i % len(ZONES)],
        },
        architectures=["x86_64-linux"],
        max_concurrent_builds=1,
        can_build=True,
    )
    return Fleet(rows, [rng.uniform(*HAVE) for _ in rows])


class Queue:
    """The clusters, created in bulk, and every member job's paths (what its JobOffer says)."""

    POOL = [f"/nix/store/{i:032x}-placement-{i}" for i in range(PATH_POOL)]

    def __init__(self, project, rng: random.Random):
        self.project, self.rng = project, rng
        self.paths: dict[str, list[str]] = {}  # job key -> paths

    def add(self, count: int) -> None:
        rng = self.rng
        zoned = [rng.random() < SAME_ZONE_SHARE for _ in range(count)]
        shapes = [[rng.random() < EVAL_SHARE for _ in range(rng.randint(2, 4))] for _ in zoned]
        paths = [[rng.sample(self.POOL, rng.randint(*PATHS_PER_JOB)) for _ in s] for s in shapes]
        _, jobs = common.make_clusters(
            (
                {"project": self.project, "same_zone": same_zone},
                [
                    ("node", "eval" if e else "build", {"paths": p}, {})
                    for e, p in zip(s, ps, strict=True)
                ],
            )
            for same_zone, s, ps in zip(zoned, shapes, paths, strict=True)
        )
        self.paths.update((j.job_key, j.paths) for j in jobs)

    def top_up(self, depth: int) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(QUEUED_SQL)
            queued = cursor.fetchone()[0]
        if queued < depth:
            self.add(depth - queued)


# Clusters that could be placed: Queued and no open attempt (members all Queued in this bench).
QUEUED_SQL = """
SELECT count(*) FROM cluster_job c WHERE c.status = 'Queued'
  AND NOT EXISTS (SELECT 1 FROM cluster_attempt a
                  WHERE a.cluster_job_id = c.id AND a.finished_at IS NULL)
"""

# The seats of the open attempts of these clusters.
SEATS_SQL = """
SELECT a.cluster_job_id, d.id, d.worker_id, d.job_id, d.missing_nar_size
FROM cluster_attempt a JOIN dispatched_job d ON d.cluster_attempt_id = a.id
WHERE a.cluster_job_id = ANY(%s) AND a.finished_at IS NULL
"""


# The offers a pass made: rows without a score written since it began.
OFFERED_SQL = """
SELECT worker_id, array_agg(job_id) FROM job_score
WHERE missing_nar_size IS NULL AND offered_at >= %s GROUP BY worker_id
"""


def full_scoring(fleet: Fleet, queue: Queue, snap, clusters: tuple) -> dict[int, int]:
    """planner.plan() over the snapshot's workers and these clusters, in this order, with
    every pair scored: each seated cluster's bytes."""
    from clusters import planner

    by_job = {
        m.key: {w.id: fleet.cost(w.id, queue.paths[m.key])[1] for w in snap.workers}
        for c in clusters
        for m in c.members
    }
    reference = planner.Snapshot(
        clusters=clusters, workers=snap.workers, score_arrays=planner.score_arrays(by_job)
    )
    return {p.cluster_id: p.cost for p in planner.plan(reference)}


def measure(run: Run, fleet: Fleet, queue: Queue, snap, seats: dict):
    """One pass's figures: its claimed clusters' seats against full scoring."""
    # Full scoring plans the book as the pass did, the clusters it held included (they kept
    # their seats in the pass too), up to the last one claimed: those after it cannot change
    # what the planner gives the ones before.
    last = max((i for i, c in enumerate(snap.clusters) if c.id in seats), default=-1)
    reference = full_scoring(fleet, queue, snap, snap.clusters[: last + 1])
    in_snapshot = {w.id for w in snap.workers}
    figures = Pass()
    for cluster_id, rows in seats.items():
        if cluster_id not in reference:
            figures.unseated += 1
            continue
        figures.placements += 1
        figures.reference += reference[cluster_id]
        for _, worker_id, key, recorded in rows:
            size = fleet.cost(worker_id, queue.paths[key])[1]
            figures.chosen += size
            figures.seats += 1
            figures.unscored += recorded is None
            run.mismatched += recorded is not None and recorded != size
            run.outside += worker_id not in in_snapshot
    run.passes.append(figures)


class Running:
    """The claimed clusters, accepted and running until their end."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.ends: list[tuple[int, list]] = []  # (the tick it ends at, seat rows)

    def start(self, seats: dict[int, list], now: int) -> None:
        from sessions import reports

        for rows in seats.values():
            for _, worker_id, key, _ in rows:
                reports.job_accepted(worker_id, key)  # the last one starts the attempt
            self.ends.append((now + self.rng.randint(*JOB_PASSES), rows))

    def finish_due(self, now: int) -> dict[int, list[str]]:
        """JobCompleted from every seat of the clusters whose run ended; the slots freed."""
        from sessions import reports

        due = [rows for end, rows in self.ends if end <= now]
        self.ends = [(end, rows) for end, rows in self.ends if end > now]
        freed = defaultdict(list)
        for rows in due:
            for assignment, worker_id, key, _ in rows:
                reports.job_completed(worker_id, key, str(assignment))
                freed[worker_id].append(key.partition(":")[0])
        return freed


def tick(run: Run, fleet: Fleet, queue: Queue, running: Running, measuring: bool) -> None:
    from django.db import connection
    from django.utils import timezone

    from clusters import dispatch, reservation
    from clusters.book import startable_clusters

    asking = fleet.stale()
    for worker_id, kinds in running.finish_due(run.ticks).items():
        asking[worker_id] += kinds
    for worker_id, kinds in asking.items():
        fleet.ask(worker_id, kinds)
    queue.top_up(run.depth)
    began = timezone.now()
    snap = dispatch.snapshot(startable_clusters(began), began, reservation.reserved_workers())
    result = dispatch.run_pass()
    with connection.cursor() as cursor:
        cursor.execute(OFFERED_SQL, [began])
        offers = cursor.fetchall()
        seats = defaultdict(list)
        if result.claimed:
            cursor.execute(SEATS_SQL, [result.claimed])
            for cluster_id, *row in cursor.fetchall():
                seats[cluster_id].append(row)
    if measuring:
        measure(run, fleet, queue, snap, seats)
    for worker_id, keys in offers:
        fleet.answer(worker_id, [(key, queue.paths[key]) for key in keys])
    for rows in seats.values():
        for _, worker_id, key, _ in rows:
            fleet.asked.pop((worker_id, key.partition(":")[0]), None)  # seated: not free
    running.start(seats, run.ticks)
    run.ticks += 1


def run_one(depth: int, args) -> Run:
    from gradient.jobs.models import Project

    common.ensure_database()
    common.flush_redis()
    rng = random.Random(SEED)
    fleet = make_fleet(args.workers, rng)
    queue = Queue(Project.objects.create(name="placement"), rng)
    queue.top_up(depth)
    common.analyze()
    for worker in fleet.workers.values():
        fleet.ask(worker.pk, fleet.slots(worker))
    running = Running(rng)
    run = Run(depth, args.workers)
    vacuumed = time.monotonic()
    while run.ticks < args.warmup + args.passes:
        began = time.monotonic()
        if began - vacuumed >= VACUUM_SECS:
            common.analyze(vacuum=True)
            vacuumed = began
        tick(run, fleet, queue, running, measuring=run.ticks >= args.warmup)
        time.sleep(max(0.0, args.tick - (time.monotonic() - began)))
    run.load = common.load()
    common.flush_redis()
    return run


def totals(run: Run) -> dict:
    out = {name: sum(getattr(p, name) for p in run.passes) for name in vars(Pass())}
    out["placing"] = sum(bool(p.placements) for p in run.passes)
    out["ratio"] = out["chosen"] / out["reference"] if out["reference"] else float("nan")
    return out


HEADER = (
    "queued clusters | workers | passes (placing) | placements / seats | chosen GiB"
    " | full scoring GiB | chosen / full | unscored seats | load"
)


def row(run: Run) -> list:
    t = totals(run)
    gib = 1 << 30
    return [
        f"{run.depth:,}" + (f", run {run.run}" if run.run else ""),
        run.workers,
        f"{len(run.passes)} ({t['placing']})",
        f"{t['placements']:,} / {t['seats']:,}",
        f"{t['chosen'] / gib:,.0f}",
        f"{t['reference'] / gib:,.0f}",
        f"{t['ratio']:.3f}",
        f"{t['unscored'] / max(t['seats'], 1):.1%}",
        run.load,
    ]


def figures(runs: list[Run]) -> list[common.Figure]:
    """Issue #18's target, on the deepest queue measured: the median of its runs."""
    if not runs:
        return []
    depth = max(r.depth for r in runs)
    ratios_ = [totals(r)["ratio"] for r in runs if r.depth == depth]
    return [
        common.Figure(
            f"placement: chosen seats' bytes over full scoring's, {depth:,} clusters queued",
            f"≤ {TARGET:g}",
            common.median_text(ratios_, digits=3),
            statistics.median(ratios_) <= TARGET,
        )
    ]


def main() -> None:
    parser = common.parser(__doc__, DATABASE_URL, REDIS_DB, runs=3)
    parser.add_argument("--depths", default="200,2000", help="queued clusters")
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10, help="passes before measuring")
    parser.add_argument("--passes", type=int, default=25, help="passes measured per depth")
    parser.add_argument("--tick", type=float, default=0.5, help="seconds between passes at least")
    args = parser.parse_args()
    common.start(args)
    common.in_memory_layer()  # the bench reads what the pass wrote instead
    runs = []
    for run in range(1, args.runs + 1):  # the depths in turn, then again
        for depth in common.parse_ints(args.depths):
            runs.append(replace(run_one(depth, args), run=run if args.runs > 1 else 0))
    odd = sum(r.outside + r.mismatched for r in runs)
    unseated = sum(totals(r)["unseated"] for r in runs)
    check = (
        f"Checks: seats off the snapshot, or whose recorded score is not the scorer's: {odd};"
        f" claimed clusters that full scoring could not seat (left out): {unseated}."
    )
    common.finish(
        args,
        "placement",
        "## Placement quality",
        common.table(HEADER, [row(r) for r in runs]),
        [check],
        figures(runs),
        load="in the table",
        crashed=bool(odd),  # the bench misread the pass
    )


if __name__ == "__main__":
    main()
