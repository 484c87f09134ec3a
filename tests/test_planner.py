"""The spec's Placement, on the pure planner: no database, plain snapshots in and out.
tests/test_planner_random.py checks it against brute force on random snapshots."""

import dataclasses

import numpy as np
import pytest

from clusters import planner
from clusters.planner import UNSCORED_COST, plan, seat_reason
from tests.planning import ARM, X86, cluster, member, names, only, snapshot, worker


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


def test_zones_come_named_in_order_then_the_zoneless_workers():
    workers = [worker(1, zone="b"), worker(2), worker(3, zone="a"), worker(4, zone="b")]

    assert planner.zones(workers) == [
        ("a", frozenset({3})),
        ("b", frozenset({1, 4})),
        (None, frozenset({2})),
    ]
    assert planner.zones(workers[:1]) == [("b", frozenset({1}))]
    assert planner.zones([]) == []


def test_score_arrays_sort_each_jobs_scores_by_size_then_worker_id():
    by_job = {"build:a": {3: 7, 1: 7, 2: 0, 9: 5}, "build:b": {}}

    built = planner.score_arrays(by_job)

    assert {k: (ids.tolist(), sizes.tolist()) for k, (ids, sizes) in built.items()} == {
        "build:a": ([2, 9, 1, 3], [0, 5, 7, 7]),
        "build:b": ([], []),
    }
    assert all(ids.dtype == sizes.dtype == np.int64 for ids, sizes in built.values())


def test_an_empty_pass_plans_nothing():
    assert plan(snapshot([], [])) == []
    assert plan(snapshot([cluster(member("a"))], [])) == []
    assert plan(snapshot([cluster()], [worker(1)])) == []


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


def truncated(snap, keys, full_scores):
    """The snapshot with none of these keys' cheapest scores read, and a loader of their
    scores that records what it was asked (keys, worker ids)."""
    asked = []

    def load(keys, worker_ids):
        asked.append((sorted(keys), sorted(worker_ids.tolist())))
        return planner.score_arrays(
            {key: {w: size for (w, k), size in full_scores.items() if k == key} for key in keys}
        )

    cheap = dataclasses.replace(snap, truncated=frozenset(keys), load_scores=load)
    return cheap, asked


def test_scores_left_unread_are_read_from_the_free_workers_alone():
    first = cluster(member("a"), id=1)
    late = cluster(member("b"), id=2)
    workers = [worker(1), worker(2), worker(3), worker(4, arch=(ARM,))]
    snap = snapshot([first, late], workers, {(1, "build:a"): 0})
    cheap, asked = truncated(snap, ["build:b"], {(2, "build:b"): 9, (3, "build:b"): 5})

    placements = plan(cheap)

    # w1 went to the first cluster, and w4 cannot build for x86: w2 and w3 are asked about.
    assert asked == [(["build:b"], [2, 3])]
    assert [names(p) for p in placements] == [["w1"], ["w3"]]


def test_a_cluster_the_free_workers_cannot_seat_reads_no_scores():
    # Both members can sit on w1 alone: no seating, whatever the scores say.
    stuck = cluster(member("a", arch=ARM), member("b", arch=ARM), id=1)
    workers = [worker(1, arch=(X86, ARM)), worker(2)]
    cheap, asked = truncated(snapshot([stuck], workers), ["build:a", "build:b"], {})

    assert plan(cheap) == []
    assert asked == []
