"""The spec's Placement: seat every cluster able to start on distinct idle workers.

Pure: stdlib, numpy and scipy only, so the dispatch pass (which reads the idle slots, the ready
clusters and the scores) and its tests call it without a database. plan() takes the clusters in
the given order (prioritized first, then oldest) and gives each the seating of least total
missing NAR size, a true minimum-cost bipartite matching; a worker seated for one cluster is not
offered to the next.

Speed (1,000 clusters over 5,000 workers in one pass): every idle worker is one column, and
eligibility a boolean mask over the columns, cached per member profile (kind, pin, architecture,
features, project). A cluster then costs a few numpy operations on its k x workers matrix, never
a Python loop over pairs, and the solver only sees each member's k cheapest seats (_cheapest).
"""

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass
from itertools import repeat

import numpy as np

# What a never-scored seat adds to Placement.cost: more than any sum of real sizes (each below
# 2**63, a bigint column), so a seating with fewer unscored seats always costs less.
UNSCORED_COST = 2**80

# The slot kinds and the capability each needs; a fetch-only worker (can_eval False) never
# seats an eval member.
KINDS = {"eval": "can_eval", "build": "can_build"}

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
    # prefix of the full list. plan() asks load_scores for a key's full arrays whenever its
    # cheapest could be too few to decide (see _place).
    truncated: frozenset[str] = frozenset()
    load_scores: Callable[[list[str]], Mapping[str, ScoreArrays]] | None = None
    # clusters/dispatch.py still passes scores={}: taken while empty, as the planner reads
    # score_arrays alone.
    scores: InitVar[Mapping | None] = None

    def __post_init__(self, scores):
        if scores:
            raise TypeError("Snapshot takes score_arrays, not flat scores")


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


def placements(snapshot: Snapshot) -> Iterator[Placement]:
    """plan(), one placement at a time, each final once yielded: the dispatch pass claims the
    first while the planner seats the next."""
    pool = _Pool(snapshot.workers)
    scores = _Scores(snapshot, pool)
    for cluster in snapshot.clusters:
        placement = _place(cluster, pool, scores)
        # A cluster without a full placement keeps waiting and takes nothing from the next.
        if placement is not None:
            pool.take(placement)
            yield placement


def score_arrays(by_job: Mapping[str, Mapping[int, int]]) -> dict[str, ScoreArrays]:
    """Snapshot.score_arrays from {job key: {worker id: missing_nar_size}}."""
    out = {}
    for key, sizes_of in by_job.items():
        ids = np.fromiter(sizes_of.keys(), np.int64, len(sizes_of))
        sizes = np.fromiter(sizes_of.values(), np.int64, len(sizes_of))
        order = np.lexsort((ids, sizes))  # by size, then worker id
        out[key] = (ids[order], sizes[order])
    return out


def _place(cluster: Cluster, pool: "_Pool", scores: "_Scores") -> Placement | None:
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


def _place_on(cluster: Cluster, seatable: np.ndarray, pool: "_Pool", scores: "_Scores"):
    """The cheapest placement on the seats that `seatable` (members x columns) allows."""
    members = cluster.members
    if not seatable.any(axis=1).all():
        return None  # a member without any seat: no need to read the scores
    groups = pool.groups(cluster.same_zone)
    rows = [scores.row(m.key) for m in members]
    apart = _apart(cluster, seatable, rows, pool, groups)
    if apart is not None:
        return apart
    # Each member's scored seats, cheapest first; per zone, the solver sees their shortlist.
    preferred = _preferred(seatable, rows)
    # A member's cheapest scores decide only while they hold k seats of every group: its k
    # cheapest there are then the same as in its full list (both sorted alike). Else read it all.
    k = len(members)
    short = [
        m.key
        for m, row, seats in zip(members, rows, preferred, strict=True)
        if not row.complete and pool.short_of(seats, cluster.same_zone, k)
    ]
    if short:
        scores.complete(short)
        rows = [scores.row(m.key) for m in members]
        preferred = _preferred(seatable, rows)
    # A truncated row leaves its member's dearer scores out of the matrix (the stand-in cost
    # instead, built from the largest size seen): those are never in a minimum-cost seating,
    # since one of its k cheapest seats is always free to move to, so the least cost is the
    # same as over the full list, and so is the seating when only one seating costs that.
    largest = max(row.largest for row in rows)
    best = None  # (cost, zone, columns, sizes)
    members_at = np.arange(k)
    for zone, columns in groups:
        cheapest = map(_cheapest, seatable, preferred, repeat(columns), repeat(k))
        shortlist = np.unique(np.concatenate(list(cheapest)))
        cost, sizes = _costs(rows, shortlist, largest)
        seating = _solve(np.where(seatable[:, shortlist], cost, np.inf))
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


def _apart(cluster: Cluster, seatable: np.ndarray, rows: list["_Row"], pool: "_Pool", groups):
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
        seats = _among_ties(seatable, rows, seats, columns)
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


def _among_ties(seatable: np.ndarray, rows: list["_Row"], seats: list, columns: slice):
    """Each member, in order, on the first free seat of the group as cheap as its cheapest
    there (`seats`), or None when one finds none: the first fit, not a matching."""
    taken: set[int] = set()
    chosen = []
    for line, row, (_, size) in zip(seatable, rows, seats, strict=True):
        at = row.columns
        fits = line[at] & (row.sizes == size) & (at >= columns.start) & (at < columns.stop)
        column = next((c for c in at[fits].tolist() if c not in taken), None)
        if column is None:
            return None
        taken.add(column)
        chosen.append((column, size))
    return chosen


def _costs(rows: list["_Row"], columns: np.ndarray, largest: int):
    """Each member's seat costs over the given columns: its missing NAR size where scored,
    else a stand-in dearer than any scored seating. (Where a column is no seat, the solver's
    matrix gets np.inf: no edge at all; a size of 0 is still an edge.) And the sizes
    themselves, -1 where unscored."""
    k = len(rows)
    # Floats add integers exactly below 2**53, so sizes stay exact up to 2**50 / k**2 (64 TiB
    # for 4 members); larger ones are scaled down, which can blur their sums but not the rule
    # below.
    top = min(largest, 2**50 // k**2)
    scale = top / largest if largest > top else 1.0
    # Sizes are byte counts (>= 0). A stand-in of 2k times the largest makes one more
    # unscored seat dearer than any difference in real sizes, rounding and all.
    cost = np.full((k, columns.size), 2.0 * k * top + 1.0)
    sizes = np.full((k, columns.size), -1, dtype=np.int64)
    for line, sized, row in zip(cost, sizes, rows, strict=True):
        found_sizes, found = row.find(columns)
        sized[found] = found_sizes[found]
        line[found] = sized[found] * scale if scale != 1.0 else sized[found]
    return cost, sizes


def _preferred(seatable: np.ndarray, rows: list["_Row"]) -> list[np.ndarray]:
    return [row.columns[line[row.columns]] for line, row in zip(seatable, rows, strict=True)]


def _cheapest(seatable: np.ndarray, preferred: np.ndarray, columns: slice, k: int) -> np.ndarray:
    """A member's k cheapest seats among the columns: scored ones by size, then unscored ones.

    A minimum-cost matching of k members never needs another seat: were a member seated
    elsewhere, one of its k cheapest would be free (the other k - 1 members hold at most k - 1),
    and moving it there costs no more. So the solver sees at most k * k columns, not thousands.
    """
    scored = preferred[(preferred >= columns.start) & (preferred < columns.stop)][:k]
    if scored.size == k:
        return scored
    unscored = seatable[columns].copy()
    unscored[scored - columns.start] = False
    return np.concatenate([scored, columns.start + np.flatnonzero(unscored)[: k - scored.size]])


def _solve(cost: np.ndarray) -> np.ndarray | None:
    """The column of each row in a minimum-cost full matching, or None if there is none."""
    # Imported here: scipy.optimize takes about a second to import, and every daphne imports
    # this module (through clusters.tracking) without ever solving; a restarted daphne must
    # listen again as soon as it can.
    from scipy.optimize import linear_sum_assignment

    try:
        seated, columns = linear_sum_assignment(cost)
    except ValueError:  # "cost matrix is infeasible": no full matching avoids every np.inf
        return None
    # Trust but verify: every member seated (not so with fewer columns than members), and
    # over real edges only.
    if seated.size != len(cost) or not np.isfinite(cost[seated, columns]).all():
        return None
    return columns


class _Pool:
    """The idle workers as columns: eligibility masks per member profile, zones, availability.

    Columns are sorted by zone, so a zone is a range of columns (a slice).
    """

    def __init__(self, workers: tuple[Worker, ...]):
        # Named zones sorted, then the zoneless workers as a zone of their own: also the
        # tie-break order between zones of equal cost.
        zones: list[str | None] = [*sorted({w.zone for w in workers} - {None}), None]
        rank = {zone: i for i, zone in enumerate(zones)}
        self.workers = tuple(sorted(workers, key=lambda w: rank[w.zone]))
        self.size = len(workers)
        self._zones: list[tuple[str | None, slice]] = []
        start, count = 0, Counter(w.zone for w in workers)
        for zone in zones:
            self._zones.append((zone, slice(start, start + count[zone])))
            start += count[zone]
        # Each column's zone, and the zones that have workers at all.
        self._zone_of = np.repeat(np.arange(len(zones)), [count[z] for z in zones])
        self._peopled = np.array([count[z] > 0 for z in zones])
        # Each column's index among the groups of a same_zone cluster (the peopled zones).
        group_of_zone = np.cumsum(self._peopled) - 1
        self._group_of_column = group_of_zone[self._zone_of]
        self._group_count = int(self._peopled.sum())
        ids = np.array([w.id for w in self.workers], dtype=np.int64)
        self._by_id = np.argsort(ids)
        self._sorted_ids = ids[self._by_id]
        # Worker ids are database keys, nearly dense: a small lookup table beats a search. Its
        # last entry stays -1 for every id out of range.
        self._lookup = None
        if self.size and ids.min() >= 0 and ids.max() < 16 * self.size + 4096:
            self._lookup = np.full(ids.max() + 2, -1, dtype=np.int64)
            self._lookup[ids] = np.arange(self.size)
        self._column = {w.id: i for i, w in enumerate(self.workers)}
        # A worker seated for one cluster is not offered to the next.
        self.available = np.ones(self.size, dtype=bool)
        # Inverted indexes, one pass each, so a new profile costs a few mask operations.
        self._by_kind = {kind: self._where(w for w in workers if _takes(w, kind)) for kind in KINDS}
        self._by_name = _inverted(self.workers, lambda w: (w.name,))
        self._by_arch = _inverted(self.workers, lambda w: w.architectures)
        self._by_feature = _inverted(self.workers, lambda w: w.features)
        self._by_project = _inverted(self.workers, lambda w: w.projects or ())
        self._every_project = self._where(w for w in workers if w.projects is None)
        self._profiles: dict[tuple, np.ndarray] = {}

    def groups(self, same_zone: bool) -> list[tuple[str | None, slice]]:
        """The column ranges a cluster may sit in: one per zone under same_zone, else all."""
        if same_zone:
            return [
                (zone, columns) for zone, columns in self._zones if columns.stop > columns.start
            ]
        return [(None, slice(0, self.size))]

    def short_of(self, seats: np.ndarray, same_zone: bool, k: int) -> bool:
        """Whether these seats (columns) number fewer than k in some column range that
        groups() gives for a cluster."""
        if not same_zone:
            return seats.size < k
        counts = np.bincount(self._zone_of[seats], minlength=self._peopled.size)
        return bool((counts[self._peopled] < k).any())

    def first_per_group(self, columns: np.ndarray, seat: np.ndarray, same_zone: bool) -> list:
        """For columns in a member's cheapest-first order and whether each is a seat, the
        position of the first seat in each of groups()'s ranges, -1 where there is none."""
        if not same_zone:
            at = int(seat.argmax()) if seat.size else 0
            return [at if seat.size and seat[at] else -1]
        # Each seat's group, the non-seats a group past the last; np.unique gives the first
        # position of each.
        groups = np.where(seat, self._group_of_column[columns], self._group_count)
        found, first = np.unique(groups, return_index=True)
        out = [-1] * self._group_count
        for group, at in zip(found.tolist(), first.tolist(), strict=True):
            if group < self._group_count:
                out[group] = at
        return out

    def eligible(self, member: Member) -> np.ndarray:
        """Columns that are a seat for the member (seat_reason None), whether seated or not."""
        profile = (member.kind, member.pin, member.architecture, member.features, member.project_id)
        mask = self._profiles.get(profile)
        if mask is None:
            mask = self._profiles[profile] = self._profile_mask(member)
        return mask

    def take(self, placement: Placement) -> None:
        for seat in placement.seats:
            self.available[self._column[seat.worker.id]] = False

    def column_of(self, worker_ids: np.ndarray) -> np.ndarray:
        """The column of each worker id, -1 for a worker not in the pool."""
        if self._lookup is not None:
            last = self._lookup.size - 1  # -1, for every id out of range
            inside = (worker_ids >= 0) & (worker_ids < last)
            return self._lookup[np.where(inside, worker_ids, last)]
        if self.size == 0:
            return np.full(worker_ids.shape, -1, dtype=np.int64)
        at = np.searchsorted(self._sorted_ids, worker_ids).clip(max=self.size - 1)
        return np.where(self._sorted_ids[at] == worker_ids, self._by_id[at], -1)

    def _profile_mask(self, member: Member) -> np.ndarray:
        mask = self._by_kind.get(member.kind, self._where(())).copy()
        if member.pin is not None:
            mask &= self._by_name.get(member.pin, False)
        mask &= self._by_arch.get(member.architecture, False)
        for feature in member.features:
            mask &= self._by_feature.get(feature, False)
        mask &= self._every_project | self._by_project.get(member.project_id, False)
        return mask

    def _where(self, workers: Iterable[Worker]) -> np.ndarray:
        mask = np.zeros(self.size, dtype=bool)
        mask[[self._column[w.id] for w in workers]] = True
        return mask


def _takes(worker: Worker, kind: str) -> bool:
    """An idle slot of the kind and the capability to run it."""
    return kind in worker.idle_kinds and getattr(worker, KINDS[kind])


def _inverted(workers: tuple[Worker, ...], values) -> dict:
    """value -> mask of the workers having it."""
    columns: dict = {}
    for column, worker in enumerate(workers):
        for value in values(worker):
            columns.setdefault(value, []).append(column)
    masks = {}
    for value, where in columns.items():
        masks[value] = np.zeros(len(workers), dtype=bool)
        masks[value][where] = True
    return masks


class _Row:
    """One job key's scores from workers in the pool, cheapest first (columns, sizes);
    `complete` False when only the cheapest are here. The same by column, for the solver's
    lookups (find), is sorted only when first asked for: most rows never reach the solver."""

    __slots__ = ("_by_column", "columns", "complete", "largest", "sizes")

    def __init__(self, columns: np.ndarray, sizes: np.ndarray, complete: bool = True):
        self.columns, self.sizes, self.complete = columns, sizes, complete
        self.largest = int(sizes[-1]) if sizes.size else 0
        self._by_column = None

    def find(self, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The size of each column where scored, and whether it is (a mask)."""
        if self._by_column is None:
            order = np.argsort(self.columns)
            self._by_column = (self.columns[order], self.sizes[order])
        by_column, sizes = self._by_column
        at = by_column.searchsorted(columns)
        at[at == by_column.size] = 0
        found = by_column[at] == columns if by_column.size else at < 0
        return sizes[at] if by_column.size else np.zeros(at.size, np.int64), found


_NO_SCORES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class _Scores:
    """Score rows per job key, read from score_arrays. score_arrays and truncated are only
    asked about one key at a time, as the planner reaches it, so a snapshot may hand them over
    while still reading them."""

    def __init__(self, snapshot: Snapshot, pool: _Pool):
        self._arrays = snapshot.score_arrays or {}
        self._truncated = snapshot.truncated
        self._full: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # rows complete() read
        self._load = snapshot.load_scores
        self._pool = pool
        self._rows: dict[str, _Row] = {}

    def row(self, key: str) -> _Row:
        row = self._rows.get(key)
        if row is None:
            if key in self._full:
                ids, sizes = self._full[key]
                complete = True
            else:
                ids, sizes = self._arrays.get(key, _NO_SCORES)
                complete = key not in self._truncated
            row = self._rows[key] = _row(self._pool.column_of(ids), sizes, complete)
        return row

    def complete(self, keys: list[str]) -> None:
        """Replace the cheapest-only rows of these keys by their full lists."""
        if self._load is None:
            raise ValueError("truncated scores without load_scores")
        full = self._load(keys)
        for key in keys:
            self._full[key] = full.get(key, _NO_SCORES)
            self._rows.pop(key, None)


def _row(columns: np.ndarray, sizes: np.ndarray, complete: bool = True) -> _Row:
    """A row of these scores, sorted by size already (columns -1 for workers not in the pool)."""
    known = columns >= 0  # a score from a worker that holds no idle slot is no use here
    if not known.all():
        columns, sizes = columns[known], sizes[known]
    return _Row(columns, sizes, complete)
