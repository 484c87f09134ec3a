"""The spec's Placement: seat every cluster able to start on distinct idle workers.

Pure: stdlib, numpy and scipy only, so the dispatch pass (which reads the idle slots, the ready
clusters and the scores) and its tests call it without a database. plan() takes the clusters in
the given order (prioritized first, then oldest) and gives each the seating of least total
missing NAR size, a true minimum-cost bipartite matching; a worker seated for one cluster is not
offered to the next.

Speed (1,000 clusters over 5,000 workers in one pass): every idle worker is one column and
eligibility a mask over the columns (clusters.pool), so a cluster costs a few numpy operations
on its k x workers matrix, never a Python loop over pairs, and the solver only sees each
member's k cheapest seats (clusters.matching).
"""

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from clusters import matching
from clusters.pool import KINDS, Pool

# What a never-scored seat adds to Placement.cost: more than any sum of real sizes (each below
# 2**63, a bigint column), so a seating with fewer unscored seats always costs less.
UNSCORED_COST = 2**80
# Why a quarantined worker seats no member (workers.health), the first reason given.
QUARANTINED = "quarantined"
# With this few workers left free, a cluster is first asked whether they can seat it at all,
# before its scores are read: late in a large pass most cannot, and a matching over a few
# hundred columns costs less than reading scores to learn it.
FEW_FREE = 256


# One job key's scores: worker ids and their missing_nar_size, sorted by (size, worker id).
type ScoreArrays = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Member:
    key: str  # job key, "eval:<uuid>" or "build:<uuid>"
    kind: str  # "eval" or "build"
    role: str
    index: int
    pin: str | None  # worker NAME the member must sit on
    architecture: str
    features: frozenset[str]  # required system features
    project_id: int


@dataclass(frozen=True)
class Cluster:
    id: int
    same_zone: bool
    members: tuple[Member, ...]
    # Workers that left one of its prepares unanswered (a timeout, a reject) since it last
    # started: seated only when no placement without them exists, so that workers that never
    # answer cannot fail the cluster's every prepare while others could seat it.
    avoid: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Worker:
    id: int
    name: str
    zone: str | None
    idle_kinds: frozenset[str]  # kinds with a live idle slot ("eval", "build")
    architectures: frozenset[str]
    features: frozenset[str]  # system features
    projects: frozenset[int] | None  # None = may access every project
    can_eval: bool
    can_build: bool
    # Quarantined (workers.health): seats no member, whatever else it could do.
    quarantined: bool = False


@dataclass(frozen=True)
class Snapshot:
    clusters: tuple[Cluster, ...]  # in priority order: prioritized first, then oldest
    workers: tuple[Worker, ...]
    # The answered scores (a NULL size is no score): job key -> (worker ids, missing_nar_size),
    # two int64 arrays of one length sorted by (size, worker id), a worker at most once per key,
    # so a query can hand over millions of scores without a Python object per pair.
    # score_arrays() builds them from plain dicts.
    score_arrays: Mapping[str, ScoreArrays] | None = None
    # Keys whose score_arrays hold only their cheapest scores, sorted by (size, worker id): a
    # prefix of the full list. plan() asks load_scores(keys, worker ids) for the keys' scores
    # from those workers (others may come along) whenever their cheapest could be too few to
    # decide (see _place): the ids are every free worker that could seat the keys' members.
    truncated: frozenset[str] = frozenset()
    load_scores: Callable[[list[str], np.ndarray], Mapping[str, ScoreArrays]] | None = None


@dataclass(frozen=True)
class Seat:
    member: Member
    worker: Worker
    missing_nar_size: int | None  # None when the pair was never scored


@dataclass(frozen=True)
class Placement:
    cluster_id: int
    zone: str | None  # the zone used under same_zone, else None
    seats: tuple[Seat, ...]  # one per member, in member order
    cost: int  # summed missing NAR size, UNSCORED_COST per never-scored seat


def seat_reason(member: Member, worker: Worker) -> str | None:
    """None if the worker is a seat for the member, else the first reason it is not."""
    if worker.quarantined:
        return QUARANTINED
    if member.kind not in worker.idle_kinds:
        return "no idle slot of that kind"
    if member.pin is not None and member.pin != worker.name:
        return "pin"
    if member.architecture not in worker.architectures:
        return "architecture"
    if not member.features <= worker.features:
        return "feature"
    if worker.projects is not None and member.project_id not in worker.projects:
        return "project access"
    if not getattr(worker, KINDS.get(member.kind, ""), False):
        return "cannot take this kind"
    return None


def plan(snapshot: Snapshot) -> list[Placement]:
    """One placement per cluster that can be fully seated, in the snapshot's cluster order."""
    return list(placements(snapshot))


def placements(
    snapshot: Snapshot, admits: Callable[[Cluster], bool] | None = None
) -> Iterator[Placement]:
    """plan(), one placement at a time, each final once yielded: the dispatch pass claims the
    first while the planner seats the next. A cluster that `admits` refuses is not placed: it
    takes no seat from the clusters after it, and costs no planning."""
    pool = Pool(snapshot.workers)
    scores = matching.Scores(snapshot, pool)
    for cluster in snapshot.clusters:
        if admits is not None and not admits(cluster):
            continue
        placement = _place(cluster, pool, scores)
        # A cluster without a full placement keeps waiting and takes nothing from the next.
        if placement is not None:
            pool.take(placement)
            yield placement


# What explain_cluster asks of the planner, so that it tells what a pass would do.


def eligible(members: Iterable[Member], workers: Iterable[Worker]) -> list[frozenset[int]]:
    """Per member, the ids of the workers that are a seat for it: plan()'s own masks, before
    zones and before any worker is taken."""
    pool = Pool(tuple(workers))
    return [frozenset(pool.ids[pool.eligible(m)].tolist()) for m in members]


def zones(workers: Iterable[Worker]) -> list[tuple[str | None, frozenset[int]]]:
    """The zones a same_zone cluster may sit in, in plan()'s order (also its tie-break between
    zones of equal cost), each with the ids of its workers."""
    pool = Pool(tuple(workers))
    return [(zone, frozenset(pool.ids[at].tolist())) for zone, at in pool.groups(same_zone=True)]


def match(seats: Sequence[Collection[int]]) -> list[int] | None:
    """A worker id per member, each on a worker of its own among its seats, or None when no
    such seating exists: plan()'s solver, every seat at one cost."""
    columns = sorted(set().union(*seats))
    at = {worker_id: column for column, worker_id in enumerate(columns)}
    cost = np.full((len(seats), len(columns)), np.inf)
    for row, ids in enumerate(seats):
        cost[row, [at[worker_id] for worker_id in ids]] = 0.0
    seating = matching.solve(cost)
    return None if seating is None else [columns[column] for column in seating.tolist()]


def score_arrays(by_job: Mapping[str, Mapping[int, int]]) -> dict[str, ScoreArrays]:
    """Snapshot.score_arrays from {job key: {worker id: missing_nar_size}}."""
    out = {}
    for key, sizes_of in by_job.items():
        ids = np.fromiter(sizes_of.keys(), np.int64, len(sizes_of))
        sizes = np.fromiter(sizes_of.values(), np.int64, len(sizes_of))
        order = np.lexsort((ids, sizes))  # by size, then worker id
        out[key] = (ids[order], sizes[order])
    return out


def _place(cluster: Cluster, pool: Pool, scores: matching.Scores) -> Placement | None:
    if not cluster.members:
        return None
    seatable = np.stack([pool.eligible(m) for m in cluster.members]) & pool.available
    if cluster.avoid:
        columns = pool.column_of(np.fromiter(cluster.avoid, dtype=np.int64))
        columns = columns[columns >= 0]
        if columns.size:
            without = seatable.copy()
            without[:, columns] = False
            placement = _place_on(cluster, without, pool, scores)
            if placement is not None:
                return placement
    return _place_on(cluster, seatable, pool, scores)


def _place_on(cluster: Cluster, seatable: np.ndarray, pool: Pool, scores: matching.Scores):
    """The cheapest placement on the seats that `seatable` (members x columns) allows."""
    members = cluster.members
    groups = pool.groups(cluster.same_zone)
    if not seatable.any(axis=1).all():
        return None  # a member without any seat: no need to read the scores
    if pool.free <= FEW_FREE and not _could_seat(seatable, groups):
        return None
    rows = [scores.row(m.key) for m in members]
    apart = _apart(cluster, seatable, rows, pool, groups)
    if apart is not None:
        return apart
    # Each member's scored seats, cheapest first; per zone, the solver sees their shortlist.
    preferred = matching.preferred(seatable, rows)
    # A member's cheapest scores decide only while they hold k seats of every group: its k
    # cheapest there are then the same as in its full list (both sorted alike). Else read its
    # scores from every free seat it has: seats are only taken during a pass, never freed, so
    # those scores stay enough for the rest of it.
    k = len(members)
    short = [
        m
        for m, row, seats in zip(members, rows, preferred, strict=True)
        if not row.complete and pool.short_of(seats, cluster.same_zone, k)
    ]
    if short:
        free = np.stack([pool.eligible(m) for m in short]).any(axis=0) & pool.available
        scores.complete([m.key for m in short], pool.ids[free])
        rows = [scores.row(m.key) for m in members]
        preferred = matching.preferred(seatable, rows)
    # A truncated row leaves its member's dearer scores out of the matrix (the stand-in cost
    # instead, built from the largest size seen): those are never in a minimum-cost seating,
    # since one of its k cheapest seats is always free to move to, so the least cost is the
    # same as over the full list, and so is the seating when only one seating costs that.
    largest = max(row.largest for row in rows)
    best = None  # (cost, zone, columns, sizes)
    members_at = np.arange(k)
    for zone, columns in groups:
        cheapest = map(matching.cheapest, seatable, preferred, repeat(columns), repeat(k))
        shortlist = np.unique(np.concatenate(list(cheapest)))
        cost, sizes = matching.costs(rows, shortlist, largest)
        seating = matching.solve(np.where(seatable[:, shortlist], cost, np.inf))
        if seating is None:
            continue
        seated = sizes[members_at, seating].tolist()
        total = sum(UNSCORED_COST if size < 0 else size for size in seated)
        # Zones come in tie-break order, so only a strictly cheaper zone replaces the best.
        if best is None or total < best[0]:
            best = (total, zone, shortlist[seating], seated)
    if best is None:
        return None
    total, zone, seated_columns, seated_sizes = best
    seats = tuple(
        Seat(member, pool.workers[column], None if size < 0 else size)
        for member, column, size in zip(members, seated_columns.tolist(), seated_sizes, strict=True)
    )
    return Placement(cluster.id, zone if cluster.same_zone else None, seats, total)


def _could_seat(seatable: np.ndarray, groups) -> bool:
    """Whether some group seats every member on a worker of its own, whatever the cost."""
    k = len(seatable)
    for _, columns in groups:
        within = seatable[:, columns]
        seats = within.sum(axis=1)
        if (seats >= k).all():
            return True  # seated in turn, each finds a seat the others before it left
        if not seats.all():
            continue
        within = within[:, within.any(axis=0)]
        if matching.solve(np.where(within, 0.0, np.inf)) is not None:
            return True
    return False


def _apart(cluster: Cluster, seatable: np.ndarray, rows: list[matching.Row], pool: Pool, groups):
    """The placement of every member on its own cheapest seat, when that is a minimum-cost
    one; else None, and the solver decides.

    No seating in a group costs less than the sum of each member's cheapest seat there, so
    when the group of the least such sum (the first of equals, the zones' tie-break) has those
    seats, or seats as cheap, on distinct workers, they are a minimum-cost seating, found
    without the solver and without a member's full list of scores: its cheapest seat is in
    its cheapest scores whenever one of those is left. Where a member has no scored seat
    among those read, the sum takes a bound (a truncated list's largest size read, else the
    unscored cost) and the group cannot be taken here. Most clusters of a large pass are
    placed this way.
    """
    # Per member, the position in its cheapest-first list of its cheapest seat in each group
    # (-1: none among its scores read).
    firsts = [
        pool.first_per_group(row.columns, line[row.columns], cluster.same_zone)
        for line, row in zip(seatable, rows, strict=True)
    ]
    best = None  # (bound, zone, seats: [(column, size)] or None, columns)
    for group, (zone, columns) in enumerate(groups):
        bound, seats = 0, []
        for first, row in zip(firsts, rows, strict=True):
            at = first[group]
            if at < 0:
                bound += UNSCORED_COST if row.complete else row.largest
                seats = None
            else:
                size = int(row.sizes[at])
                bound += size
                if seats is not None:
                    seats.append((int(row.columns[at]), size))
        if best is None or bound < best[0]:
            best = (bound, zone, seats, columns)
    if best is None or best[2] is None:
        return None
    total, zone, seats, columns = best
    if len({column for column, _ in seats}) < len(seats):
        # Two members' cheapest is one worker: another seat just as cheap may do (sizes tie
        # often, a worker that has everything costs 0 to all); else a matching decides.
        seats = matching.among_ties(seatable, rows, seats, columns)
        if seats is None:
            return None
    return Placement(
        cluster.id,
        zone if cluster.same_zone else None,
        tuple(
            Seat(member, pool.workers[column], size)
            for member, (column, size) in zip(cluster.members, seats, strict=True)
        ),
        total,
    )
