"""Operators see worker health: show_worker, quarantine_worker, /metrics, and the settings."""

import json
import os
import subprocess
import sys

import pytest

from clusters import coordinator
from clusters.claim import claim_cluster
from clusters.settlement import member_report
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import claim_for, make_cluster
from tests.commands import ROOT, manage
from tests.factories import WorkerFactory
from tests.test_metrics import scrape, value
from workers import health
from workers.models import Worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


def run_json(*args) -> dict:
    done = manage(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refused(*args) -> str:
    done = manage(*args)
    assert done.returncode != 0 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def attempt_on(worker, partner):
    cluster = make_cluster()
    claim = claim_for(cluster, [worker, partner])
    assert claim_cluster(claim)
    rows = {
        r.worker_id: r for r in DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
    }
    return cluster, claim.attempt_id, rows[worker.pk]


def test_show_worker_lists_its_seats_newest_first_with_their_blame():
    flaky = WorkerFactory(name="flaky", zone="z1", channel_name="live")
    partner = WorkerFactory()
    first, first_attempt, row = attempt_on(flaky, partner)
    coordinator.member_rejected(flaky.pk, row.job_id, "no")
    second, second_attempt, row = attempt_on(flaky, partner)
    for r in DispatchedJob.objects.filter(cluster_attempt_id=second_attempt):
        coordinator.accept_assignment(r.worker_id, r.job_id)
    member_report(flaky.pk, row.job_id, row.pk, "Completed")
    role = "server" if row.kind == "eval" else "client"

    out = run_json("show_worker", "flaky")
    assert {k: out[k] for k in ("worker", "connected", "zone", "draining", "quarantined")} == {
        "worker": "flaky",
        "connected": True,
        "zone": "z1",
        "draining": False,
        "quarantined": None,
    }
    seats = [
        {k: s[k] for k in ("attempt", "cluster", "role", "index", "outcome", "blamed")}
        for s in out["recent_seats"]
    ]
    assert seats[0] == {
        "attempt": str(second_attempt),
        "cluster": second.pk,
        "role": role,
        "index": 0,
        "outcome": "Completed",
        "blamed": False,
    }
    assert seats[1]["attempt"] == str(first_attempt) and seats[1]["cluster"] == first.pk
    assert (seats[1]["outcome"], seats[1]["blamed"]) == ("Abandoned", True)
    assert out["recent_seats"][1]["blame"] == "rejected"


def test_show_worker_keeps_to_the_twenty_newest_seats():
    worker, partner = WorkerFactory(name="busy"), WorkerFactory()
    for _ in range(21):
        attempt_on(worker, partner)
    assert len(run_json("show_worker", "busy")["recent_seats"]) == 20


def test_quarantine_worker_quarantines_until_released():
    WorkerFactory(name="sick")
    assert run_json("quarantine_worker", "sick", "--reason", "bad disk") == {
        "worker": "sick",
        "quarantined": True,
    }
    shown = run_json("show_worker", "sick")["quarantined"]
    assert (shown["reason"], shown["by"]) == ("bad disk", "operator")
    assert shown["since"].endswith("Z")
    assert run_json("quarantine_worker", "sick", "--release") == {
        "worker": "sick",
        "quarantined": False,
    }
    assert run_json("show_worker", "sick")["quarantined"] is None


def test_bad_health_commands_are_refused_and_change_nothing():
    WorkerFactory(name="sick")
    assert "unknown worker 'nobody'" in refused("show_worker", "nobody")
    assert "unknown worker 'nobody'" in refused("quarantine_worker", "nobody")
    assert "--reason cannot be combined with --release" in refused(
        "quarantine_worker", "sick", "--release", "--reason", "x"
    )
    assert "longer than 500" in refused("quarantine_worker", "sick", "--reason", "x" * 501)
    assert "given more than once" in refused(
        "quarantine_worker", "sick", "--reason", "a", "--reason", "b"
    )
    assert Worker.objects.get(name="sick").quarantined_until is None


def test_metrics_count_quarantined_workers_and_blamed_seats_by_blame():
    flaky, partner = WorkerFactory(), WorkerFactory()
    _, _, row = attempt_on(flaky, partner)
    coordinator.member_rejected(flaky.pk, row.job_id, "no")
    health.quarantine(partner, "operator's call")
    samples = scrape()
    assert value(samples, "gradient_blamed_seats_total", blame="rejected") == 1
    assert value(samples, "gradient_blamed_seats_total", blame="lost") == 0
    assert value(samples, "gradient_quarantined_workers", by="operator") == 1
    assert value(samples, "gradient_quarantined_workers", by="automatic") == 0


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("GRADIENT_QUARANTINE_AFTER", "-1", "GRADIENT_QUARANTINE_AFTER must not be negative"),
        ("GRADIENT_QUARANTINE_AFTER", "three", "GRADIENT_QUARANTINE_AFTER"),
        ("GRADIENT_QUARANTINE_SECS", "0", "GRADIENT_QUARANTINE_SECS must be positive"),
    ],
)
def test_bad_health_settings_stop_the_process_with_a_clear_error(variable, value, message):
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "gradient.settings", variable: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert message in done.stderr
