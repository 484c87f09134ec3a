"""/metrics: what the rows say, read at scrape time, and what the passes and sessions record in
Redis; structured logs carrying cluster, attempt and worker ids."""

import io
import json
import logging
import uuid
from datetime import timedelta

import pytest
import redis
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from clusters import coordinator
from clusters.dispatch import PASS_LOCK, run_pass
from clusters.models import ClusterAttempt, ClusterJob
from clusters.retention import run_retention
from clusters.settlement import member_report
from gradient import metrics
from gradient.asgi import application
from gradient.jobs.models import DispatchedJob
from gradient.logs import JsonFormatter, ids
from gradient.redis_db import redis_url
from gradient.wire.protocol import MemberRef
from tests.clusterflow import Inbox, committed, idle_workers
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot

TEST_REDIS_DB = 12
CAPS = {
    "type": "WorkerCapabilities",
    "architectures": ["x86_64-linux"],
    "system_features": [],
    "max_concurrent_builds": 1,
    "max_concurrent_evals": 1,
    "eval": True,
    "build": True,
    "fetch": True,
    "zone": "z1",
    "endpoint": "10.0.0.1:7000",
}


@pytest.fixture(autouse=True)
def metrics_redis(memory_layer, settings):
    """The Redis part of the metrics in a database of its own, empty at the start."""
    settings.REDIS_URL = redis_url(TEST_REDIS_DB)
    metrics._down_until.clear()
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    metrics._down_until.clear()


def scrape(client=None, **headers) -> dict:
    response = (client or Client()).get("/metrics", **headers)
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def started_cluster():
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    workers = idle_workers(2)
    inbox = Inbox(workers)
    assert run_pass().claimed == [cluster.pk]
    rows = {r.kind: r for r in DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster)}
    for row in rows.values():
        coordinator.accept_assignment(row.worker_id, row.job_id)
    for w in workers:
        inbox.frames(w)
    return cluster, rows


@committed
def test_the_metrics_follow_a_cluster_from_queued_to_started_to_completed():
    before = scrape()
    cluster, rows = started_cluster()
    running = scrape()
    for row in rows.values():
        member_report(row.worker_id, row.job_id, row.pk, "Completed")
    done = scrape()

    series = [before, running, done]
    assert [value(m, "gradient_clusters", status="Running") for m in series] == [0, 1, 0]
    assert [value(m, "gradient_clusters", status="Completed") for m in series] == [0, 0, 1]
    assert [value(m, "gradient_cluster_queued_to_started_seconds_count") for m in series] == [
        0,
        1,
        1,
    ]
    assert [value(m, "gradient_cluster_attempts_total", outcome="Succeeded") for m in series] == [
        0,
        0,
        1,
    ]
    assert [value(m, "gradient_cluster_attempts_open", phase="started") for m in series] == [
        0,
        1,
        0,
    ]
    assert [
        value(m, "gradient_cluster_prepare_seconds_count", result="started") for m in series
    ] == [0, 1, 1]
    # Buckets are cumulative and end with every sample.
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    wait = (attempt.started_at - cluster.created_at).total_seconds()
    assert value(done, "gradient_cluster_queued_to_started_seconds_bucket", le="1.0") == 1
    assert value(done, "gradient_cluster_queued_to_started_seconds_bucket", le="+Inf") == 1
    assert value(done, "gradient_cluster_queued_to_started_seconds_sum") == pytest.approx(wait)


@committed
def test_a_failed_prepare_is_timed_apart_from_started_ones():
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    idle_workers(2)
    assert run_pass().claimed == [cluster.pk]
    assert value(scrape(), "gradient_cluster_attempts_open", phase="preparing") == 1
    coordinator.abort_prepare(ClusterAttempt.objects.get().pk, "timeout")
    samples = scrape()
    assert value(samples, "gradient_cluster_prepare_seconds_count", result="failed") == 1
    assert value(samples, "gradient_cluster_prepare_seconds_count", result="started") == 0
    assert value(samples, "gradient_cluster_attempts_total", outcome="PrepareFailed") == 1
    assert value(samples, "gradient_cluster_queued_to_started_seconds_count") == 0


def cumulative(samples) -> dict:
    """The counter and histogram samples over attempts: what must never go down."""
    names = (
        "gradient_cluster_attempts_total",
        "gradient_cluster_queued_to_started_seconds_",
        "gradient_cluster_prepare_seconds_",
    )
    return {k: v for k, v in samples.items() if k[0].startswith(names)}


@committed
def test_the_retention_pass_deleting_clusters_never_lowers_a_counter(settings):
    settings.GRADIENT = {**settings.GRADIENT, "RETENTION_DAYS": 1}
    completed, rows = started_cluster()
    for row in rows.values():
        member_report(row.worker_id, row.job_id, row.pk, "Completed")
    failed = ClusterFactory()
    EvalMemberFactory(cluster_job=failed, role="server")
    BuildMemberFactory(cluster_job=failed, role="client")
    IdleSlot.objects.all().delete()
    idle_workers(2)
    assert run_pass().claimed == [failed.pk]
    coordinator.abort_prepare(ClusterAttempt.objects.get(cluster_job=failed).pk, "timeout")
    ClusterJob.objects.filter(pk=failed.pk).update(status="Failed")
    kept = started_cluster()[0]  # running: retention keeps it
    before = cumulative(scrape())
    assert value(before, "gradient_cluster_attempts_total", outcome="Succeeded") == 1
    assert value(before, "gradient_cluster_attempts_total", outcome="PrepareFailed") == 1
    assert value(before, "gradient_cluster_prepare_seconds_count", result="started") == 2

    old = timezone.now() - timedelta(days=2)
    ClusterJob.objects.filter(pk__in=[completed.pk, failed.pk]).update(updated_at=old)
    assert run_retention() == 2
    assert list(ClusterJob.objects.values_list("pk", flat=True)) == [kept.pk]
    assert cumulative(scrape()) == pytest.approx(before)

    # New attempts add to the tallied ones; a second pass tallies nothing twice.
    for row in DispatchedJob.objects.filter(cluster_attempt__cluster_job=kept):
        member_report(row.worker_id, row.job_id, row.pk, "Completed")
    ClusterJob.objects.filter(pk=kept.pk).update(updated_at=old)
    assert run_retention() == 1
    assert run_retention() == 0
    after = scrape()
    assert value(after, "gradient_cluster_attempts_total", outcome="Succeeded") == 2
    assert value(after, "gradient_cluster_prepare_seconds_count", result="started") == 2
    assert value(after, "gradient_cluster_prepare_seconds_count", result="failed") == 1
    assert value(after, "gradient_cluster_queued_to_started_seconds_count") == 2
    assert ClusterAttempt.objects.count() == 0


@pytest.mark.django_db
def test_idle_slots_and_connected_workers_reflect_the_rows(settings):
    idle_workers(2)
    stale = WorkerFactory(channel_name="live", last_seen_at=timezone.now())
    ttl = settings.GRADIENT["IDLE_SLOT_TTL_SECS"]
    IdleSlot.objects.create(
        worker=stale, kind="build", recorded_at=timezone.now() - timedelta(seconds=ttl + 5)
    )
    WorkerFactory(channel_name=None)  # not connected
    samples = scrape()
    assert value(samples, "gradient_idle_slots", kind="eval") == 2
    assert value(samples, "gradient_idle_slots", kind="build") == 2  # the stale one is not
    assert value(samples, "gradient_connected_workers") == 3


@committed
def test_every_dispatch_pass_that_runs_is_timed_and_a_skipped_one_is_not():
    assert value(scrape(), "gradient_dispatch_pass_seconds_count") == 0
    result = run_pass()
    samples = scrape()
    assert value(samples, "gradient_dispatch_pass_seconds_count") == 1
    assert value(samples, "gradient_dispatch_pass_seconds_sum") == pytest.approx(result.seconds)
    assert value(samples, "gradient_dispatch_pass_seconds_bucket", le="+Inf") == 1

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [PASS_LOCK])
        assert run_pass().skipped
    finally:
        other.close()
    assert value(scrape(), "gradient_dispatch_pass_seconds_count") == 1


@committed
def test_forwarded_signals_are_counted():
    _, rows = started_cluster()
    assert value(scrape(), "gradient_signals_forwarded_total") == 0
    attempt = str(rows["eval"].cluster_attempt_id)
    coordinator.forward_signal(
        rows["eval"].worker_id, attempt, MemberRef(role="client", index=0), 1
    )
    coordinator.forward_signal(rows["build"].worker_id, attempt, None, 2)
    samples = scrape()
    assert value(samples, "gradient_signals_forwarded_total") == 2
    assert value(samples, "gradient_signals_dropped_total") == 0


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_signal_the_session_refuses_is_counted_as_dropped():
    worker = await database_sync_to_async(WorkerFactory)()
    ws = WebsocketCommunicator(
        application,
        "/proto",
        headers=[(b"authorization", f"Bearer token-{worker.name}".encode())],
    )
    connected, _ = await ws.connect()
    assert connected
    await ws.send_json_to(CAPS)
    assert (await ws.receive_json_from(3))["type"] == "InitAck"
    await ws.send_json_to({"type": "ClusterSignal", "attempt": str(uuid.uuid4()), "payload": 1})
    while (frame := await ws.receive_json_from(3))["type"] != "Error":
        pass
    assert frame["code"] == "not_allowed"
    await ws.disconnect()
    samples = await database_sync_to_async(scrape)()
    assert value(samples, "gradient_signals_dropped_total") == 1
    assert value(samples, "gradient_signals_forwarded_total") == 0


@committed
def test_a_redis_outage_breaks_neither_the_pass_nor_the_signals_nor_the_scrape(settings, caplog):
    _, rows = started_cluster()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    result = run_pass()
    assert not result.skipped
    attempt = str(rows["eval"].cluster_attempt_id)
    assert coordinator.forward_signal(rows["eval"].worker_id, attempt, None, 1) == 1
    metrics.count_signal_dropped()
    assert "could not record a metric in Redis" in caplog.text
    samples = scrape()
    assert value(samples, "gradient_metrics_redis_up") == 0
    assert value(samples, "gradient_clusters", status="Running") == 1
    assert ("gradient_dispatch_pass_seconds_count", ()) not in samples


@pytest.mark.django_db
def test_a_metrics_token_when_set_is_required(settings):
    client = Client()
    assert client.get("/metrics").status_code == 200  # open by default
    settings.METRICS_TOKEN = "s3cret"
    refused = client.get("/metrics")
    assert refused.status_code == 401
    assert refused["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic s3cret").status_code == 401
    samples = scrape(client, HTTP_AUTHORIZATION="Bearer s3cret")
    assert value(samples, "gradient_metrics_redis_up") == 1
    assert client.post("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 405


@pytest.mark.django_db
def test_openmetrics_is_served_to_a_scraper_that_asks_for_it():
    response = Client().get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


def json_lines(records) -> list[dict]:
    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in records]


def test_the_json_formatter_emits_the_ids_passed_in_extra():
    attempt = uuid.uuid4()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tests.metrics.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning(
            "attempt %s of cluster %s", attempt, 7, extra=ids(cluster=7, attempt=attempt, worker=3)
        )
        logger.warning("nothing to name")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == f"attempt {attempt} of cluster 7"
    assert (first["cluster"], first["attempt"], first["worker"]) == (7, str(attempt), 3)
    assert first["level"] == "WARNING"
    assert first["logger"] == "tests.metrics.json"
    assert "time" in first
    assert not {"cluster", "attempt", "worker"} & set(second)


@committed
def test_the_passes_log_the_cluster_attempt_and_workers_they_act_on(caplog):
    caplog.set_level(logging.INFO)
    cluster, rows = started_cluster()
    attempt = ClusterAttempt.objects.get(cluster_job=cluster).pk
    workers = sorted(row.worker_id for row in rows.values())
    claimed, started = (
        next(r for r in caplog.records if text in r.getMessage())
        for text in ("claimed as attempt", "started with")
    )
    claimed, started = json_lines([claimed, started])
    assert claimed["cluster"] == cluster.pk
    assert claimed["attempt"] == str(attempt)
    assert sorted(claimed["worker"]) == workers
    assert started["attempt"] == str(attempt)
    assert sorted(started["worker"]) == workers
