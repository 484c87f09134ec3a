"""Which idle workers a member is asked of (clusters.asking.Seating): the planner's own
eligibility, taken in turn from each zone, each zone read cyclically from the member's own
place, so that the members of a pass are not all asked of the same few workers."""

from clusters.asking import Seating, _rotated
from tests import planning


def names(workers) -> list[str]:
    return [w.name for w in workers]


def test_a_member_is_asked_of_each_zone_in_turn_from_its_own_place():
    fleet = [planning.worker(i, zone="a", name=f"a{i}") for i in range(3)] + [
        planning.worker(10 + i, zone="b", name=f"b{i}") for i in range(3)
    ]
    seating = Seating(tuple(fleet))
    member = planning.member("m")
    assert names(seating.candidates(member, 1, 4)) == ["a1", "b1", "a2", "b2"]
    # Read cyclically: from the last worker of each zone on, and never one twice.
    assert names(seating.candidates(member, 2, 6)) == ["a2", "b2", "a0", "b0", "a1", "b1"]
    assert names(seating.candidates(member, 5, 10)) == ["a2", "b2", "a0", "b0", "a1", "b1"]


def test_only_the_workers_the_planner_would_seat_it_on_are_candidates():
    fleet = (
        planning.worker(1, zone="a", name="arm", arch=(planning.ARM,)),
        planning.worker(2, zone="a", name="x86"),
        planning.worker(3, zone="b", name="kvm", features=("kvm",)),
    )
    seating = Seating(fleet)
    assert names(seating.candidates(planning.member("m"), 0, 10)) == ["x86", "kvm"]
    assert names(seating.candidates(planning.member("k", features=("kvm",)), 0, 10)) == ["kvm"]
    pinned = planning.member("p", pin="x86")
    assert names(seating.candidates(pinned, 7, 10)) == ["x86"]
    assert seating.candidates(planning.member("q", pin="arm"), 0, 10) == []


def test_a_zone_of_several_kinds_of_worker_is_read_as_one_list():
    assert _rotated([["x0", "x1"], ["y0"]], 1, 3) == ["x1", "y0", "x0"]
    assert _rotated([["x0", "x1"], ["y0"]], 2, 2) == ["y0", "x0"]
    assert _rotated([["x0"], []], 4, 5) == ["x0"]
    assert _rotated([[], []], 0, 3) == []
