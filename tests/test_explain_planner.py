"""explain_cluster and the dispatch pass agree, over random fleets and clusters on the real
database: for each member, the workers explain says could seat it are the ones the planner
finds eligible in the pass's own snapshot (within the zones that seat every member, under
same_zone), and explain finds a cluster unblocked exactly when planner.plan places it alone."""

import dataclasses
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, example, given
from hypothesis import settings as property_settings
from hypothesis import strategies as st

from clusters import planner
from clusters.book import startable_clusters
from clusters.dispatch import snapshot
from clusters.explain import explain
from clusters.pool import KINDS
from tests.factories import (
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    ProjectFactory,
    WorkerFactory,
)
from workers.models import IdleSlot

pytestmark = pytest.mark.django_db

ARCHS = ["x86_64-linux", "aarch64-linux"]
FEATURES = ["kvm", "big-parallel"]
PROJECTS = 2


def mostly(usual, *rare):
    """The usual value, six times as likely as each rare one: most workers can seat most
    members, so that placements and their near misses both come up."""
    return st.sampled_from([usual] * 6 + list(rare))


worker_specs = st.fixed_dictionaries(
    {
        "zone": st.sampled_from(["a", "a", "b", None]),
        # Per kind: a live idle slot, none, or one older than the TTL.
        "slots": st.fixed_dictionaries({kind: mostly("live", None, "stale") for kind in KINDS}),
        "architectures": mostly(ARCHS[:1], ARCHS[1:], ARCHS, ARCHS),
        "features": mostly((), tuple(FEATURES), FEATURES[:1]),
        # None: every project; else the indexes of the projects it may access.
        "projects": mostly(None, (), (0,), (1,), (0, 1)),
        "can_eval": mostly(True, False),
        "can_build": mostly(True, False),
        "draining": mostly(False, True),
        "state": mostly("connected", "gone", "revoked"),
        # The index of the cluster its seat is reserved for, if any.
        "reserved_for": mostly(None, 0, 1),
    }
)

member_specs = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(sorted(KINDS)),
        # The index of the worker it is pinned to (past the last: a worker not connected).
        "pin": mostly(None, 0, 1, 2, 6),
        "architecture": mostly(ARCHS[0], ARCHS[1]),
        "features": mostly((), FEATURES[:1]),
    }
)


cluster_specs = st.fixed_dictionaries(
    {
        "same_zone": st.booleans(),
        "project": st.integers(0, PROJECTS - 1),
        "members": st.lists(member_specs, min_size=1, max_size=4),
    }
)


def make_worker(name: str, spec: dict, projects: list, now, ttl: float):
    worker = WorkerFactory(
        name=name,
        zone=spec["zone"],
        architectures=spec["architectures"],
        system_features=list(spec["features"]),
        all_projects=spec["projects"] is None,
        can_eval=spec["can_eval"],
        can_build=spec["can_build"],
        draining=spec["draining"],
        channel_name=None if spec["state"] == "gone" else "live",
        revoked_at=now if spec["state"] == "revoked" else None,
        last_seen_at=now,
    )
    worker.projects.add(*(projects[i] for i in spec["projects"] or ()))
    for kind, slot in spec["slots"].items():
        if slot is not None:
            age = 0 if slot == "live" else 2 * ttl
            IdleSlot.objects.create(
                worker=worker, kind=kind, recorded_at=now - timedelta(seconds=age)
            )
    return worker


def make_cluster(spec: dict, projects: list, names: list[str]):
    cluster = ClusterFactory(project=projects[spec["project"]], same_zone=spec["same_zone"])
    for m in spec["members"]:
        pin = None if m["pin"] is None else (names[m["pin"]] if m["pin"] < len(names) else "gone")
        job = {"architecture": m["architecture"], "required_features": list(m["features"])}
        if m["kind"] == "eval":
            fields = {f"evaluation__{k}": v for k, v in job.items()}
            EvalMemberFactory(cluster_job=cluster, role="server", pin=pin, **fields)
        else:
            fields = {f"derivation_build__{k}": v for k, v in job.items()}
            BuildMemberFactory(cluster_job=cluster, role="client", pin=pin, **fields)
    return cluster


def within(snap: planner.Snapshot, zone: str | None) -> planner.Snapshot:
    return dataclasses.replace(snap, workers=tuple(w for w in snap.workers if w.zone == zone))


def planners_view(book_entry, now, reserved: dict[int, int]):
    """What the pass would plan this cluster over, alone: its snapshot, the workers the planner
    finds eligible per member (within the zones seating every member, under same_zone), and
    its placement."""
    others = [w for w, c in reserved.items() if c != book_entry.id]
    snap = snapshot([book_entry], now, others)
    [cluster] = snap.clusters
    eligible = planner.eligible(cluster.members, snap.workers)
    placed = planner.plan(snap)
    if cluster.same_zone:
        zones = {w.zone for w in snap.workers}
        full = {z for z in zones if planner.plan(within(snap, z))}
        if full:
            inside = {w.id for w in snap.workers if w.zone in full}
            eligible = [ids & inside for ids in eligible]
    return cluster, eligible, placed


def check(fleet: list[dict], clusters: list[dict], ttl: float) -> None:
    now = timezone.now()
    projects = [ProjectFactory() for _ in range(PROJECTS)]
    names = [f"w{i}" for i in range(len(fleet))]
    workers = [make_worker(n, s, projects, now, ttl) for n, s in zip(names, fleet, strict=True)]
    made = [make_cluster(c, projects, names) for c in clusters]
    reserved = {
        w.pk: made[s["reserved_for"]].pk
        for w, s in zip(workers, fleet, strict=True)
        if s["reserved_for"] is not None and s["reserved_for"] < len(made)
    }
    book = {c.id: c for c in startable_clusters(now)}
    ids = {w.pk: w.name for w in workers}

    for made_cluster in made:
        out = explain(made_cluster.pk, now=now, reserved=reserved)
        assert out["waiting"], out
        cluster, eligible, placed = planners_view(book[made_cluster.pk], now, reserved)
        by_key = {m["job_id"]: m for m in out["members"]}
        for member, ids_eligible in zip(cluster.members, eligible, strict=True):
            told = by_key[member.key]
            expected = {ids[i] for i in ids_eligible}
            assert set(told["candidates"]) == expected, (told, sorted(expected))
            assert all(o["reason"] for o in told["others"]), told
        unblocked = out["summary"].startswith("Not blocked")
        assert unblocked == bool(placed), (out["summary"], placed)
        if cluster.same_zone and placed:
            # No scores, so every zone seating the cluster costs the same: the planner takes
            # the first in its order, which explain must list first.
            assert out["zones"]["full"][0] == placed[0].zone, out


def a_worker(**spec) -> dict:
    """A worker spec that can seat any member but for what `spec` says."""
    usual = {
        "zone": None,
        "slots": {kind: "live" for kind in KINDS},
        "architectures": ARCHS[:1],
        "features": (),
        "projects": None,
        "can_eval": True,
        "can_build": True,
        "draining": False,
        "state": "connected",
        "reserved_for": None,
    }
    return {**usual, **spec}


def a_cluster(members: int, *, same_zone=False, **member) -> dict:
    usual = {"kind": "build", "pin": None, "architecture": ARCHS[0], "features": ()}
    return {"same_zone": same_zone, "project": 0, "members": [{**usual, **member}] * members}


@property_settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fleet=st.lists(worker_specs, min_size=1, max_size=6),
    clusters=st.lists(cluster_specs, min_size=1, max_size=2),
)
# Besides the random ones, a case of each outcome: two zones of equal cost and a seat in a
# third, members competing for too few workers, and the workers a pass leaves out of its
# snapshot.
@example(
    fleet=[a_worker(zone=z) for z in ("b", "a", None, "b", "a")],
    clusters=[a_cluster(2, same_zone=True)],
)
@example(fleet=[a_worker(), a_worker()], clusters=[a_cluster(3)])
@example(
    fleet=[
        a_worker(),
        a_worker(draining=True),
        a_worker(slots={"eval": "live", "build": "stale"}),
        a_worker(reserved_for=1),
        a_worker(reserved_for=0),
        a_worker(state="gone"),
        a_worker(projects=(1,)),
    ],
    clusters=[a_cluster(2), a_cluster(1)],
)
def test_explain_could_seat_what_the_planner_would(fleet, clusters):
    ttl = settings.GRADIENT["IDLE_SLOT_TTL_SECS"]
    # One savepoint per example, rolled back: each starts from the test's empty database.
    with transaction.atomic():
        check(fleet, clusters, ttl)
        transaction.set_rollback(True)
