"""explain_cluster: why a cluster waits, on the real database."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from clusters import explain as explaining
from clusters.explain import explain
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from gradient.jobs.models import BuildStatus, DispatchedJob
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot

pytestmark = pytest.mark.django_db


def connected(name, kinds=("eval", "build"), age=0, **fields):
    """A connected worker with idle slots recorded `age` seconds ago."""
    now = timezone.now()
    worker = WorkerFactory(name=name, channel_name="live", last_seen_at=now, **fields)
    for kind in kinds:
        IdleSlot.objects.create(worker=worker, kind=kind, recorded_at=now - timedelta(seconds=age))
    return worker


def build_cluster(clients=1, **fields):
    cluster = ClusterFactory(**fields)
    for _ in range(clients):
        BuildMemberFactory(cluster_job=cluster, role="client")
    return cluster


def member(out, label):
    return next(m for m in out["members"] if m["member"] == label)


def why(out, label="client/0") -> dict:
    """worker name -> reason, for one member; candidates as None."""
    m = member(out, label)
    return {**{w: None for w in m["candidates"]}, **{o["worker"]: o["reason"] for o in m["others"]}}


# One test per reason a connected worker cannot seat a member.


def test_a_worker_with_a_live_slot_of_the_kind_is_a_candidate_and_one_without_is_not():
    cluster = build_cluster()
    connected("w1", kinds=["build"])
    connected("w2", kinds=["eval"])
    WorkerFactory(name="gone")  # disconnected: not listed
    connected("revoked", revoked_at=timezone.now())

    out = explain(cluster.pk)

    assert out["waiting"] is True
    [m] = out["members"]
    assert {k: m[k] for k in ("role", "index", "kind", "pin")} == {
        "role": "client",
        "index": 0,
        "kind": "build",
        "pin": None,
    }
    assert m["job_id"] == f"build:{cluster.members.get().derivation_build_id}"
    assert m["candidates"] == ["w1"]
    assert m["others"] == [{"worker": "w2", "reason": "no idle slot of that kind"}]
    assert out["summary"].startswith("Not blocked: every member has a seat")


def test_an_idle_slot_older_than_the_ttl_is_stale(settings):
    settings.GRADIENT = {**settings.GRADIENT, "IDLE_SLOT_TTL_SECS": 25}
    cluster = build_cluster()
    connected("w1", kinds=["build"], age=60)
    assert why(explain(cluster.pk)) == {"w1": "idle slot stale"}


def test_a_draining_worker_seats_nothing():
    cluster = build_cluster()
    connected("w1", kinds=["build"], draining=True)
    assert why(explain(cluster.pk)) == {"w1": "draining"}


def test_a_pinned_member_sits_only_on_its_worker():
    cluster = ClusterFactory()
    BuildMemberFactory(cluster_job=cluster, role="client", pin="w1")
    connected("w1")
    connected("w2")
    out = explain(cluster.pk)
    assert why(out) == {"w1": None, "w2": "pin"}
    assert member(out, "client/0")["pin"] == "w1"


def test_a_worker_of_another_architecture_cannot_seat_the_member():
    cluster = build_cluster()
    connected("w1")
    connected("w2", architectures=["aarch64-linux"])
    assert why(explain(cluster.pk)) == {"w1": None, "w2": "architecture"}


def test_a_worker_lacking_a_required_feature_cannot_seat_the_member():
    cluster = ClusterFactory()
    BuildMemberFactory(cluster_job=cluster, derivation_build__required_features=["kvm"])
    connected("w1", system_features=["kvm", "big-parallel"])
    connected("w2", system_features=["big-parallel"])
    assert why(explain(cluster.pk)) == {"w1": None, "w2": "feature"}


def test_a_worker_without_access_to_the_project_cannot_seat_the_member():
    cluster = build_cluster()
    connected("w1", all_projects=False).projects.add(cluster.project)
    connected("w2", all_projects=False)
    assert why(explain(cluster.pk)) == {"w1": None, "w2": "project access"}


def test_a_fetch_only_worker_cannot_take_an_eval_member():
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    connected("w1")
    connected("fetcher", can_eval=False)
    assert why(explain(cluster.pk), "server/0") == {"fetcher": "cannot take this kind", "w1": None}


def test_a_worker_reserved_for_another_cluster_is_not_a_seat():
    cluster = build_cluster()
    other = build_cluster()
    w1, w2 = connected("w1"), connected("w2")

    out = explain(cluster.pk, reserved={w1.pk: cluster.pk, w2.pk: other.pk})

    assert why(out) == {"w1": None, "w2": "reserved for another cluster"}
    assert why(explain(cluster.pk)) == {"w1": None, "w2": None}  # no active reservation


def test_the_active_reservation_is_what_explain_sees():
    from django.utils import timezone

    from clusters.models import ClusterReservation, ReservationSeat

    cluster, other = build_cluster(), build_cluster()
    connected("w1")
    w2 = connected("w2")
    held = ClusterReservation.objects.create(cluster_job=other, created_at=timezone.now())
    ReservationSeat.objects.create(reservation=held, worker=w2, kind="build", job_id="build:x")
    assert why(explain(cluster.pk)) == {"w1": None, "w2": "reserved for another cluster"}


def test_under_same_zone_only_zones_seating_every_member_count():
    cluster = ClusterFactory(same_zone=True)
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    connected("a1", zone="a")
    connected("a2", zone="a")
    connected("b1", zone="b")  # alone: zone b cannot seat two members
    connected("loose")  # the zoneless workers are a zone of their own

    out = explain(cluster.pk)

    assert out["zones"] == {
        "full": ["a"],
        "short": [
            {"zone": "b", "members": ["client/0", "server/0"], "workers": ["b1"],
             "text": "2 members compete for 1 worker"},
            {"zone": None, "members": ["client/0", "server/0"], "workers": ["loose"],
             "text": "2 members compete for 1 worker"},
        ],
    }  # fmt: skip
    for label in ("client/0", "server/0"):
        assert why(out, label) == {
            "a1": None,
            "a2": None,
            "b1": "in another zone",
            "loose": "in another zone",
        }
    assert "blocking" not in out
    assert out["summary"].startswith("Not blocked: every member has a seat in zone a")


def test_under_same_zone_without_a_full_zone_each_zone_says_whom_it_cannot_seat():
    cluster = ClusterFactory(same_zone=True)
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    connected("a1", kinds=["eval"], zone="a")
    connected("b1", kinds=["build"], zone="b")

    out = explain(cluster.pk)

    assert out["zones"] == {
        "full": [],
        "short": [
            {"zone": "a", "members": ["client/0"], "text": "no seat for client/0"},
            {"zone": "b", "members": ["server/0"], "text": "no seat for server/0"},
        ],
    }
    # Across zones they would fit, so no worker is "in another zone".
    assert why(out, "server/0") == {"a1": None, "b1": "no idle slot of that kind"}
    assert "blocking" not in out
    assert out["summary"] == (
        "Waiting: no single zone can seat every member "
        "(zone a: no seat for client/0; zone b: no seat for server/0)."
    )


# Not in the book: not waiting for seats at all.


def test_a_running_cluster_names_its_started_attempt():
    cluster = build_cluster(status=ClusterStatus.RUNNING)
    started = timezone.now()
    attempt = ClusterAttempt.objects.create(
        cluster_job=cluster, created_at=started, started_at=started
    )
    out = explain(cluster.pk)
    assert out["waiting"] is False
    assert out["reason"].startswith(f"Running: attempt {attempt.pk} started at ")
    assert "members" not in out


def test_a_finished_cluster_just_says_so():
    cluster = build_cluster(status=ClusterStatus.COMPLETED)
    out = explain(cluster.pk)
    assert (out["waiting"], out["reason"], out["summary"]) == (False, "Completed", "Completed")


def test_an_open_attempt_keeps_a_queued_cluster_out_of_the_book():
    cluster = build_cluster()
    connected("w1")
    attempt = ClusterAttempt.objects.create(cluster_job=cluster, created_at=timezone.now())
    out = explain(cluster.pk)
    assert out["waiting"] is False
    assert out["reason"].startswith(f"preparing: attempt {attempt.pk} open since ")


def test_a_failed_prepare_backs_off_then_the_cluster_is_back_in_the_book(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_RETRY_BACKOFF_SECS": 30}
    cluster = build_cluster()
    connected("w1")
    failed = timezone.now() - timedelta(seconds=5)
    ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=failed,
        finished_at=failed,
        outcome=AttemptOutcome.PREPARE_FAILED,
    )

    out = explain(cluster.pk)

    until = explaining.iso_utc(failed + timedelta(seconds=30))
    assert out["waiting"] is False
    assert out["reason"].startswith(f"backing off until {until} after a failed prepare")
    assert explain(cluster.pk, now=timezone.now() + timedelta(seconds=30))["waiting"] is True


def test_a_member_open_as_a_single_assignment_holds_its_cluster_back():
    cluster = build_cluster()
    w1 = connected("w1")
    build = cluster.members.get().derivation_build
    DispatchedJob.objects.create(
        kind="build",
        job_id=f"build:{build.pk}",
        derivation_build=build,
        worker=w1,
        project=cluster.project,
        dispatched_at=timezone.now(),
    )
    out = explain(cluster.pk)
    assert out["waiting"] is False
    assert out["reason"] == "member client/0 is open as a single assignment on worker w1"


def test_a_member_whose_job_cannot_start_holds_its_cluster_back():
    cluster = build_cluster(clients=2)
    build = cluster.members.order_by("id").first().derivation_build
    build.status = BuildStatus.CREATED
    build.save()
    out = explain(cluster.pk)
    assert out["waiting"] is False
    assert out["reason"] == f"member client/0's job build:{build.pk} cannot start (Created)"


# Every member has a seat, but not each a worker of its own: Hall's condition.


def test_three_members_competing_for_two_workers_are_the_blocking_set():
    cluster = build_cluster(clients=3)
    connected("w1")
    connected("w2")

    out = explain(cluster.pk)

    assert all(m["candidates"] == ["w1", "w2"] for m in out["members"])
    assert out["blocking"] == {
        "members": ["client/0", "client/1", "client/2"],
        "workers": ["w1", "w2"],
        "text": "3 members compete for 2 workers",
    }
    assert out["summary"] == (
        "Waiting: 3 members compete for 2 workers: client/0, client/1, client/2 "
        "can only sit on w1, w2."
    )


def test_the_blocking_set_is_the_smallest_one():
    # The whole cluster (4 members on 2 workers) violates Hall's condition, but the two
    # members pinned to w1 already do.
    cluster = ClusterFactory()
    BuildMemberFactory(cluster_job=cluster, role="a", pin="w1")
    BuildMemberFactory(cluster_job=cluster, role="a", pin="w1")
    BuildMemberFactory(cluster_job=cluster, role="b", pin="w2")
    BuildMemberFactory(cluster_job=cluster, role="c")
    for name in ("w1", "w2"):
        connected(name)

    assert explain(cluster.pk)["blocking"] == {
        "members": ["a/0", "a/1"],
        "workers": ["w1"],
        "text": "2 members compete for 1 worker",
    }


def test_many_members_fall_back_to_a_violating_set_none_of_them_can_leave():
    # 14 members: the first 12 each have a worker of their own (and worker 12 too); the last
    # two only worker 12.
    seats = [{i, 12} for i in range(12)] + [{12}, {12}]
    subset = explaining._violating(seats)
    assert len(set().union(*(seats[i] for i in subset))) < len(subset)
    assert set(subset) >= {12, 13}


def test_a_member_without_any_seat_is_named_with_its_reasons():
    cluster = ClusterFactory()
    BuildMemberFactory(cluster_job=cluster, role="client", pin="w9")
    connected("w1")
    connected("w2", kinds=["eval"])
    out = explain(cluster.pk)
    assert "blocking" not in out
    assert out["summary"] == (
        "Waiting: no worker can seat client/0 (pin: 1, no idle slot of that kind: 1)."
    )


def test_without_connected_workers_the_summary_says_so():
    cluster = build_cluster()
    assert explain(cluster.pk)["summary"] == "Waiting: no worker is connected."


# The command.


def test_the_command_prints_the_explanation_as_one_json_object():
    cluster = build_cluster(clients=3)
    connected("w1")
    connected("w2")
    out = StringIO()
    call_command("explain_cluster", str(cluster.pk), stdout=out)
    (line,) = out.getvalue().splitlines()
    assert json.loads(line) == explain(cluster.pk)


@pytest.mark.parametrize(
    ("arg", "error"),
    [("999999", "unknown cluster 999999"), ("abc", "invalid int value: 'abc'")],
)
def test_the_command_refuses_a_bad_id_in_one_line(arg, error):
    out = StringIO()
    with pytest.raises(CommandError) as refused:
        call_command("explain_cluster", arg, stdout=out)
    assert error in str(refused.value)
    assert "\n" not in str(refused.value)
    assert out.getvalue() == ""


def test_the_summary_names_the_member_without_a_seat_not_the_first_one():
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="a")
    BuildMemberFactory(cluster_job=cluster, role="b", pin="nowhere-else")
    connected("w1")
    summary = explain(cluster.pk)["summary"]
    assert summary.startswith("Waiting: no worker can seat b/0 (pin: 1")
