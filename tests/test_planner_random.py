"""The planner against the obvious, slow definitions, on random snapshots: no database.

`python -m tests.test_planner_random` times one dispatch pass over 1,000 clusters of 4 members
and 5,000 idle workers in 3 zones (benchmark_snapshot).
"""

import dataclasses
import itertools
import random
import time

import numpy as np
import pytest

from clusters import planner
from clusters.planner import (
    UNSCORED_COST,
    Cluster,
    Member,
    Placement,
    Snapshot,
    Worker,
    plan,
    seat_reason,
)
from clusters.pool import Pool
from tests.planning import ARM, X86, arrays, cluster, flat, member, snapshot, worker

ARCHS = [X86, ARM]
FEATURES = ["kvm", "big-parallel", "benchmark"]


def random_workers(rng: random.Random, count: int, sparse_ids: bool) -> list[Worker]:
    # Sparse ids (far apart) take the planner's search path, dense ones its lookup table.
    ids = rng.sample(range(1, 10**12), count) if sparse_ids else list(range(1, count + 1))
    return [
        worker(
            id,
            zone=rng.choice(["a", "b", None]),
            idle=rng.choice([(), ("eval",), ("build",), ("eval", "build"), ("eval", "build")]),
            arch=rng.sample(ARCHS, rng.randint(1, 2)),
            features=[f for f in FEATURES if rng.random() < 0.7],
            projects=rng.choice([None, None, None, [1], [2], [1, 2]]),
            can_eval=rng.random() < 0.8,
            can_build=rng.random() < 0.9,
            name=f"w{i}",
        )
        for i, id in enumerate(ids)
    ]


def random_member(rng: random.Random, key: str, workers: list[Worker]) -> Member:
    return member(
        key,
        kind=rng.choice(["eval", "build"]),
        pin=rng.choice([w.name for w in workers]) if rng.random() < 0.15 else None,
        arch=rng.choice(ARCHS),
        features=[f for f in FEATURES[:2] if rng.random() < 0.25],
        project=rng.choice([1, 2]),
    )


def random_snapshot(seed: int, clusters: int, workers: int, most_members: int) -> Snapshot:
    rng = random.Random(seed)
    pool = random_workers(rng, workers, sparse_ids=seed % 2 == 1)
    ready = []
    for c in range(clusters):
        size = rng.randint(1, most_members)
        members = [random_member(rng, f"{c}-{i}", pool) for i in range(size)]
        ready.append(cluster(*members, id=c + 1, same_zone=rng.random() < 0.5))
    scores = {}
    for m in (m for c in ready for m in c.members):
        for w in pool:
            if rng.random() < 0.5:
                # Small sizes, so that ties (and zeros) happen.
                scores[(w.id, m.key)] = rng.choice([0, rng.randint(0, 5), rng.randint(0, 10**12)])
        scores[(-5, m.key)] = 0  # a worker that is gone: no seat
    return snapshot(ready, pool, scores)


def brute_force_cost(c: Cluster, workers: list[Worker], scores) -> int | None:
    """The least Placement.cost over every seating, by trying them all."""
    zones = {w.zone for w in workers} if c.same_zone else {"any"}
    costs = []
    for zone in zones:
        group = [w for w in workers if not c.same_zone or w.zone == zone]
        for seating in itertools.permutations(group, len(c.members)):
            pairs = list(zip(c.members, seating, strict=True))
            if all(seat_reason(m, w) is None for m, w in pairs):
                costs.append(sum(scores.get((w.id, m.key), UNSCORED_COST) for m, w in pairs))
    return min(costs, default=None)


def assert_sound(snap: Snapshot, placements: list[Placement]) -> None:
    clusters = {c.id: c for c in snap.clusters}
    scores = flat(snap)
    used = [seat.worker.id for p in placements for seat in p.seats]
    assert len(used) == len(set(used)), "a worker seated twice in one pass"
    for p in placements:
        c = clusters[p.cluster_id]
        assert [seat.member for seat in p.seats] == list(c.members)
        for seat in p.seats:
            assert seat_reason(seat.member, seat.worker) is None
            assert seat.missing_nar_size == scores.get((seat.worker.id, seat.member.key))
        if c.same_zone:
            assert {seat.worker.zone for seat in p.seats} == {p.zone}
        else:
            assert p.zone is None


def assert_cheapest_in_turn(snap: Snapshot, placements: list[Placement]) -> None:
    """Sound placements, each cluster's at the least cost over the workers that the clusters
    before it left (none where no seating exists)."""
    assert_sound(snap, placements)
    scores = flat(snap)
    placed = {p.cluster_id: p for p in placements}
    taken: set[int] = set()
    for c in snap.clusters:
        left = [w for w in snap.workers if w.id not in taken]
        best = brute_force_cost(c, left, scores)
        assert (placed[c.id].cost if c.id in placed else None) == best, f"cluster {c.id}"
        if c.id in placed:
            taken |= {seat.worker.id for seat in placed[c.id].seats}


@pytest.mark.parametrize("seed", range(60))
def test_each_placement_is_the_cheapest_seating_left_in_the_pass(seed):
    snap = random_snapshot(seed, clusters=5, workers=8, most_members=4)

    placements = plan(snap)

    assert_cheapest_in_turn(snap, placements)


@pytest.mark.parametrize("seed", range(20))
def test_seat_reason_agrees_with_the_planner(seed):
    snap = random_snapshot(seed, clusters=12, workers=15, most_members=1)
    members = [m for c in snap.clusters for m in c.members]
    scores = flat(snap)
    reasons = set()

    # Pair by pair, through plan().
    for m in members:
        for w in snap.workers:
            reason = seat_reason(m, w)
            reasons.add(reason)
            placed = plan(snapshot([cluster(m)], [w], scores))
            assert (placed != []) == (reason is None), (m, w, reason)
    # And the cached masks over the whole pool, in its own (zone-sorted) column order.
    pool = Pool(snap.workers)
    for m in members:
        expected = [seat_reason(m, w) is None for w in pool.workers]
        assert pool.eligible(m).tolist() == expected, m
    # And what explain_cluster reads of them.
    assert planner.eligible(members, snap.workers) == [
        frozenset(w.id for w in snap.workers if seat_reason(m, w) is None) for m in members
    ]

    assert None in reasons and len(reasons) >= 4


@pytest.mark.parametrize("seed", range(40))
def test_match_seats_every_member_on_its_own_worker_whenever_one_can(seed):
    rng = random.Random(seed)
    members = rng.randint(1, 5)
    seats = [{w for w in range(1, 6) if rng.random() < 0.4} for _ in range(members)]
    possible = any(
        all(w in s for w, s in zip(seating, seats, strict=True))
        for seating in itertools.permutations(range(1, 6), members)
    )

    found = planner.match(seats)

    assert (found is not None) == possible, seats
    if found is not None:
        assert len(set(found)) == members
        assert all(w in s for w, s in zip(found, seats, strict=True))


def cheapest_only(snap: Snapshot, keep: int) -> tuple[Snapshot, list]:
    """The snapshot as the dispatch pass reads it: each job's `keep` cheapest scores by (size,
    worker id), and a loader for the rest (the keys it was asked for are recorded)."""
    full: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    by_job: dict[str, list[tuple[int, int]]] = {}
    for (worker_id, key), size in flat(snap).items():
        by_job.setdefault(key, []).append((size, worker_id))
    for key, pairs in by_job.items():
        pairs.sort()
        full[key] = (np.array([w for _, w in pairs]), np.array([s for s, _ in pairs]))
    prefixes, truncated = {}, set()
    for key, (ids, sizes) in full.items():
        prefixes[key] = (ids[:keep], sizes[:keep])
        if ids.size > keep:
            truncated.add(key)
    asked: list = []

    def load(keys, worker_ids):
        # Only the workers asked about: a planner that asked about too few would misplace.
        asked.append(list(keys))
        out = {}
        for key in set(keys) & set(full):
            ids, sizes = full[key]
            kept = np.isin(ids, worker_ids)
            out[key] = (ids[kept], sizes[kept])
        return out

    cheap = dataclasses.replace(
        snap, score_arrays=prefixes, truncated=frozenset(truncated), load_scores=load
    )
    return cheap, asked


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("keep", [0, 1, 3])
def test_the_cheapest_scores_alone_place_at_the_same_least_cost(seed, keep):
    # Ties are common here (small sizes): a seating may differ among equally cheap ones,
    # never in cost.
    snap = random_snapshot(seed, clusters=5, workers=8, most_members=4)
    cheap, _ = cheapest_only(snap, keep)

    placements = plan(cheap)

    assert_cheapest_in_turn(snap, placements)


@pytest.mark.parametrize("seed", range(5))
def test_the_cheapest_scores_alone_give_the_same_placements_without_ties(seed):
    snap = benchmark_snapshot(clusters=150, workers=600, seed=seed)
    rng = random.Random(seed)
    scores = flat(snap)
    sizes = rng.sample(range(10 * 2**30), len(scores))  # distinct: a single optimum
    snap = dataclasses.replace(snap, score_arrays=arrays(dict(zip(scores, sizes, strict=True))))
    cheap, asked = cheapest_only(snap, keep=16)

    assert plan(cheap) == plan(snap)
    assert asked  # some members ran out of their cheapest seats and were read in full
    assert sum(map(len, asked)) < len({m.key for c in snap.clusters for m in c.members})


# Timing: one dispatch pass at the size the spec's scheduler must handle.


def benchmark_snapshot(
    clusters=1000, members=4, workers=5000, zones=3, scored=0.2, seed=1
) -> Snapshot:
    """Seeded and random: profiles drawn from a few architectures, features and projects."""
    rng = random.Random(seed)
    pool = [
        worker(
            i + 1,
            zone=f"zone-{i % zones}",
            idle=rng.choice([("build",), ("eval", "build")]),
            arch=rng.choice([[X86], [X86], [ARM], [X86, ARM]]),
            features=[f for f in FEATURES if rng.random() < 0.7],
            projects=None if rng.random() < 0.7 else rng.sample(range(10), 5),
            can_eval=rng.random() < 0.9,
        )
        for i in range(workers)
    ]
    ready = []
    for c in range(clusters):
        seats = []
        for i in range(members):
            kind = "eval" if rng.random() < 0.25 else "build"
            pin = f"w{rng.randint(1, workers)}" if rng.random() < 0.01 else None
            arch = X86 if rng.random() < 0.85 else ARM
            features = [f for f in FEATURES[:2] if rng.random() < 0.2]
            seats.append(
                member(f"{c}-{i}", kind=kind, pin=pin, arch=arch, features=features, index=i)
            )
        ready.append(cluster(*seats, id=c + 1, same_zone=rng.random() < 0.5))
    ids = [w.id for w in pool]
    scores = {}
    for m in (m for c in ready for m in c.members):
        for worker_id in rng.sample(ids, int(workers * scored)):
            scores[(worker_id, m.key)] = rng.randrange(10 * 2**30)
    return snapshot(ready, pool, scores)


def time_plan(snap: Snapshot, runs: int = 5) -> tuple[float, float, int]:
    """The fastest of a few runs, wall and CPU seconds (the machine is shared), and how many
    clusters were placed."""
    wall, cpu, placed = float("inf"), float("inf"), 0
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        placed = len(plan(snap))
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu, placed


if __name__ == "__main__":
    snap = benchmark_snapshot()
    scored = sum(ids.size for ids, _ in snap.score_arrays.values())
    print(f"{len(snap.clusters)} clusters, {len(snap.workers)} workers, {scored} scores")
    wall, cpu, placed = time_plan(snap)
    print(f"plan: {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU, {placed} placed")
