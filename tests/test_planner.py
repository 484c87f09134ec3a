"""The spec's Placement, on the pure planner: no database, plain snapshots in and out.

`python -m tests.test_planner` times one dispatch pass over 1,000 clusters of 4 members and
5,000 idle workers in 3 zones (benchmark_snapshot).
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

X86 = "x86_64-linux"
ARM = "aarch64-linux"


def worker(
    id,
    *,
    zone=None,
    idle=("build",),
    arch=(X86,),
    features=(),
    projects=None,
    can_eval=True,
    can_build=True,
    name=None,
):
    return Worker(
        id=id,
        name=name or f"w{id}",
        zone=zone,
        idle_kinds=frozenset(idle),
        architectures=frozenset(arch),
        features=frozenset(features),
        projects=None if projects is None else frozenset(projects),
        can_eval=can_eval,
        can_build=can_build,
    )


def member(key, *, kind="build", pin=None, arch=X86, features=(), project=1, index=0):
    return Member(
        key=f"{kind}:{key}",
        kind=kind,
        role="node",
        index=index,
        pin=pin,
        architecture=arch,
        features=frozenset(features),
        project_id=project,
    )


def cluster(*members, id=1, same_zone=False):
    return Cluster(id=id, same_zone=same_zone, members=tuple(members))


def arrays(scores: dict[tuple[int, str], int]) -> dict:
    """Snapshot.score_arrays from flat scores, {(worker id, job key): missing_nar_size}."""
    by_job: dict[str, dict[int, int]] = {}
    for (worker_id, key), size in scores.items():
        by_job.setdefault(key, {})[worker_id] = size
    return planner.score_arrays(by_job)


def flat(snap: Snapshot) -> dict[tuple[int, str], int]:
    """The snapshot's scores as {(worker id, job key): missing_nar_size}."""
    return {
        (worker_id, key): size
        for key, (ids, sizes) in (snap.score_arrays or {}).items()
        for worker_id, size in zip(ids.tolist(), sizes.tolist(), strict=True)
    }


def snapshot(clusters, workers, scores=None):
    return Snapshot(
        clusters=tuple(clusters), workers=tuple(workers), score_arrays=arrays(scores or {})
    )


def names(placement: Placement) -> list[str]:
    return [seat.worker.name for seat in placement.seats]


def only(placements: list[Placement]) -> Placement:
    assert len(placements) == 1
    return placements[0]


def test_a_pinned_member_sits_on_its_worker():
    free, pinned = member("a"), member("b", pin="w1")
    # w1 is the cheaper seat for the free member too; the pin still wins it for b.
    scores = {(1, free.key): 0, (2, free.key): 500}

    placement = only(plan(snapshot([cluster(free, pinned)], [worker(1), worker(2)], scores)))

    assert names(placement) == ["w2", "w1"]


def test_a_pinned_member_waits_for_its_worker():
    pinned = member("a", pin="w9")

    assert plan(snapshot([cluster(pinned)], [worker(1), worker(2)])) == []


def test_two_idle_kinds_on_one_worker_still_seat_one_member():
    members = (member("a", kind="eval"), member("b", kind="build"))
    both = worker(1, idle=("eval", "build"))

    assert plan(snapshot([cluster(*members)], [both])) == []
    placement = only(plan(snapshot([cluster(*members)], [both, worker(2)])))
    assert names(placement) == ["w1", "w2"]


def test_a_same_zone_cluster_stays_in_one_zone():
    members = (member("a"), member("b"))
    workers = [worker(1, zone="a"), worker(2, zone="b"), worker(3, zone="b")]

    placement = only(plan(snapshot([cluster(*members, same_zone=True)], workers)))

    assert sorted(names(placement)) == ["w2", "w3"]
    assert placement.zone == "b"


def test_zoneless_workers_form_one_zone():
    members = (member("a"), member("b"))
    two_zoneless = [worker(1), worker(2), worker(3, zone="a")]
    one_of_each = [worker(1), worker(3, zone="a")]

    placement = only(plan(snapshot([cluster(*members, same_zone=True)], two_zoneless)))
    assert sorted(names(placement)) == ["w1", "w2"]
    assert placement.zone is None
    # A zoneless worker and a zoned one are two zones, never one.
    assert plan(snapshot([cluster(*members, same_zone=True)], one_of_each)) == []


def test_the_zone_with_less_to_fetch_wins():
    a, b = member("a"), member("b")
    workers = [worker(1, zone="a"), worker(2, zone="a"), worker(3, zone="b"), worker(4, zone="b")]
    size = {1: 900, 2: 900, 3: 10, 4: 10}
    scores = {(w, m.key): size[w] for w in size for m in (a, b)}

    placement = only(plan(snapshot([cluster(a, b, same_zone=True)], workers, scores)))

    assert (placement.zone, placement.cost) == ("b", 20)
    assert sorted(names(placement)) == ["w3", "w4"]


def test_zones_of_equal_cost_go_by_name_and_the_zoneless_zone_last():
    a = member("a")
    workers = [worker(1), worker(2, zone="b"), worker(3, zone="a")]

    placement = only(plan(snapshot([cluster(a, same_zone=True)], workers)))
    assert (placement.zone, names(placement)) == ("a", ["w3"])

    placement = only(plan(snapshot([cluster(a, same_zone=True)], [worker(1), worker(2, zone="b")])))
    assert (placement.zone, names(placement)) == ("b", ["w2"])


def test_a_cluster_larger_than_every_zone_is_not_placed():
    members = (member("a"), member("b"))
    workers = [worker(1, zone="a"), worker(2, zone="b"), worker(3)]

    assert plan(snapshot([cluster(*members, same_zone=True)], workers)) == []


def test_without_same_zone_members_spread_over_zones():
    members = (member("a"), member("b"), member("c"))
    workers = [worker(1, zone="a"), worker(2, zone="b"), worker(3)]

    placement = only(plan(snapshot([cluster(*members)], workers)))

    assert placement.zone is None
    assert sorted(names(placement)) == ["w1", "w2", "w3"]


def test_one_pass_never_seats_two_clusters_on_one_worker():
    first = cluster(member("a"), member("b"), id=1)
    second = cluster(member("c"), member("d"), id=2)
    # Every member would rather sit on w1 and w2.
    scores = {(w, m.key): 0 for w in (1, 2) for c in (first, second) for m in c.members}

    three = plan(snapshot([first, second], [worker(1), worker(2), worker(3)], scores))
    four = plan(snapshot([first, second], [worker(i) for i in (1, 2, 3, 4)], scores))

    assert [(p.cluster_id, sorted(names(p))) for p in three] == [(1, ["w1", "w2"])]
    assert [(p.cluster_id, sorted(names(p))) for p in four] == [
        (1, ["w1", "w2"]),
        (2, ["w3", "w4"]),
    ]


def test_the_seating_of_least_total_missing_size_wins():
    a, b = member("a"), member("b")
    # Greedy (a takes its cheapest seat first, or the cheapest pair first) pays 1 + 1000;
    # the minimum-cost matching pays 100 + 2.
    scores = {(1, a.key): 1, (2, a.key): 100, (1, b.key): 2, (2, b.key): 1000}

    placement = only(plan(snapshot([cluster(a, b)], [worker(1), worker(2)], scores)))

    assert names(placement) == ["w2", "w1"]
    assert placement.cost == 102
    assert [s.missing_nar_size for s in placement.seats] == [100, 2]

    # Among many seats: a gives w1 up to b for its cheapest other seat, w4, not just any.
    scores = {(1, a.key): 1, (2, a.key): 70, (3, a.key): 60, (4, a.key): 50, (1, b.key): 2}
    workers = [worker(i) for i in (1, 2, 3, 4)]
    placement = only(plan(snapshot([cluster(a, b)], workers, scores)))
    assert (names(placement), placement.cost) == (["w4", "w1"], 52)


def test_large_sizes_still_add_up_exactly():
    a, b = member("a"), member("b")
    big = 2**45  # 32 TiB
    scores = {(1, a.key): big, (2, a.key): big + 2, (1, b.key): big + 1, (2, b.key): big + 2}

    placement = only(plan(snapshot([cluster(a, b)], [worker(1), worker(2)], scores)))

    assert (names(placement), placement.cost) == (["w1", "w2"], 2 * big + 2)


def test_a_zero_cost_pair_is_still_a_seat():
    a, b = member("a"), member("b")
    scores = {(1, a.key): 0, (2, b.key): 0}

    placement = only(plan(snapshot([cluster(a, b)], [worker(1), worker(2)], scores)))

    assert names(placement) == ["w1", "w2"]
    assert placement.cost == 0
    assert [s.missing_nar_size for s in placement.seats] == [0, 0]


def test_an_unscored_pair_is_the_most_expensive_seat_but_still_a_seat():
    a, b = member("a"), member("b")
    huge = 5 * 10**15

    alone = only(plan(snapshot([cluster(a)], [worker(1)])))
    assert alone.seats[0].missing_nar_size is None
    assert alone.cost == UNSCORED_COST

    # a on w1 would cost nothing, but leave b on its unscored seat: the scored seating wins
    # however large its sizes.
    scores = {(1, a.key): 0, (2, a.key): huge, (1, b.key): huge}
    placement = only(plan(snapshot([cluster(a, b)], [worker(1), worker(2)], scores)))
    assert names(placement) == ["w2", "w1"]
    assert placement.cost == 2 * huge


def test_a_score_from_a_worker_without_an_idle_slot_is_ignored():
    a = member("a")
    scores = {(1, a.key): 10, (2, a.key): 50, (99, a.key): 0}

    placement = only(plan(snapshot([cluster(a)], [worker(1), worker(2)], scores)))

    assert (names(placement), placement.cost) == (["w1"], 10)


def test_a_fetch_only_worker_never_seats_an_eval_member():
    fetch_only = worker(1, idle=("eval", "build"), can_eval=False)

    assert plan(snapshot([cluster(member("a", kind="eval"))], [fetch_only])) == []
    assert names(only(plan(snapshot([cluster(member("a"))], [fetch_only])))) == ["w1"]


@pytest.mark.parametrize(
    ("lacking", "reason"),
    [
        (worker(1, arch=(ARM,)), "architecture"),
        (worker(1, features=("kvm",)), "feature"),
        (worker(1, features=("kvm", "big-parallel"), projects=[2]), "project access"),
    ],
)
def test_project_access_features_and_architecture_are_respected(lacking, reason):
    needy = member("a", features=("kvm", "big-parallel"), project=1)
    able = worker(2, features=("kvm", "big-parallel", "benchmark"), projects=[1, 2])

    assert seat_reason(needy, lacking) == reason
    assert plan(snapshot([cluster(needy)], [lacking])) == []
    assert names(only(plan(snapshot([cluster(needy)], [lacking, able])))) == ["w2"]


def test_a_cluster_that_cannot_be_placed_does_not_block_the_next():
    # The first cluster could seat one member on w1, but not the other: it takes nothing.
    stuck = cluster(member("a"), member("b", arch=ARM), id=1)
    next_ = cluster(member("c", pin="w1"), id=2)

    placement = only(plan(snapshot([stuck, next_], [worker(1)])))

    assert (placement.cluster_id, names(placement)) == (2, ["w1"])


def test_seat_reason_names_the_first_reason_in_order():
    needy = member("a", kind="eval", pin="w1", arch=ARM, features=("kvm",), project=3)
    unfit = dict(idle=("build",), arch=(X86,), features=(), projects=[1], can_eval=False)
    reasons = [
        "no idle slot of that kind",
        "pin",
        "architecture",
        "feature",
        "project access",
        "cannot take this kind",
    ]
    fixes = [
        ("idle", ("eval",)),
        ("name", "w1"),
        ("arch", (ARM,)),
        ("features", ("kvm",)),
        ("projects", None),
        ("can_eval", True),
    ]
    settings = {**unfit, "name": "w7"}
    for reason, (field, value) in zip(reasons, fixes, strict=True):
        assert seat_reason(needy, worker(7, **settings)) == reason
        settings[field] = value
    assert seat_reason(needy, worker(7, **settings)) is None


# Randomized checks against the obvious, slow definitions.

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


@pytest.mark.parametrize("seed", range(60))
def test_each_placement_is_the_cheapest_seating_left_in_the_pass(seed):
    snap = random_snapshot(seed, clusters=5, workers=8, most_members=4)

    placements = plan(snap)

    assert_sound(snap, placements)
    placed = {p.cluster_id: p for p in placements}
    taken: set[int] = set()
    for c in snap.clusters:
        left = [w for w in snap.workers if w.id not in taken]
        best = brute_force_cost(c, left, flat(snap))
        assert (placed[c.id].cost if c.id in placed else None) == best, f"cluster {c.id}"
        if c.id in placed:
            taken |= {seat.worker.id for seat in placed[c.id].seats}


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


def test_zones_come_named_in_order_then_the_zoneless_workers():
    workers = [worker(1, zone="b"), worker(2), worker(3, zone="a"), worker(4, zone="b")]

    assert planner.zones(workers) == [
        ("a", frozenset({3})),
        ("b", frozenset({1, 4})),
        (None, frozenset({2})),
    ]
    assert planner.zones(workers[:1]) == [("b", frozenset({1}))]
    assert planner.zones([]) == []


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


def test_score_arrays_sort_each_jobs_scores_by_size_then_worker_id():
    by_job = {"build:a": {3: 7, 1: 7, 2: 0, 9: 5}, "build:b": {}}

    built = planner.score_arrays(by_job)

    assert {k: (ids.tolist(), sizes.tolist()) for k, (ids, sizes) in built.items()} == {
        "build:a": ([2, 9, 1, 3], [0, 5, 7, 7]),
        "build:b": ([], []),
    }
    assert all(ids.dtype == sizes.dtype == np.int64 for ids, sizes in built.values())


def test_a_snapshot_refuses_flat_scores():
    with pytest.raises(TypeError):
        Snapshot(clusters=(), workers=(), scores={(1, "build:a"): 0})
    assert plan(Snapshot(clusters=(), workers=(), scores={})) == []


def cheapest_only(snap: Snapshot, keep: int) -> tuple[Snapshot, list]:
    """The snapshot as the dispatch pass reads it: each job's `keep` cheapest scores by (size,
    worker id), and a loader for the full lists (the keys it was asked for are recorded)."""
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

    def load(keys):
        asked.append(list(keys))
        return {k: full[k] for k in keys if k in full}

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

    assert_sound(snap, placements)
    placed = {p.cluster_id: p for p in placements}
    taken: set[int] = set()
    for c in snap.clusters:
        left = [w for w in snap.workers if w.id not in taken]
        best = brute_force_cost(c, left, flat(snap))
        assert (placed[c.id].cost if c.id in placed else None) == best, f"cluster {c.id}"
        if c.id in placed:
            taken |= {seat.worker.id for seat in placed[c.id].seats}


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


def test_an_empty_pass_plans_nothing():
    assert plan(snapshot([], [])) == []
    assert plan(snapshot([cluster(member("a"))], [])) == []
    assert plan(snapshot([cluster()], [worker(1)])) == []


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


def test_a_worker_that_left_the_last_prepare_unanswered_is_seated_only_when_needed():
    a, b = member("a"), member("b")
    # w1 is the cheapest seat, but it never answered the cluster's last prepare.
    scores = {(1, a.key): 0, (2, a.key): 100, (3, a.key): 100}
    avoiding = dataclasses.replace(cluster(a, b), avoid=frozenset({1}))
    placement = only(plan(snapshot([avoiding], [worker(1), worker(2), worker(3)], scores)))
    assert 1 not in [seat.worker.id for seat in placement.seats]
    # With no placement without it, the cluster still sits rather than waits.
    placement = only(plan(snapshot([avoiding], [worker(1), worker(2)], scores)))
    assert sorted(seat.worker.id for seat in placement.seats) == [1, 2]
