"""Metrics at /metrics, in Prometheus' exposition format.

Processes keep no counts of their own: a scrape asks PostgreSQL what its rows say, each
histogram counted by one aggregate. What leaves no row (a dispatch pass's duration, a
ClusterSignal forwarded or dropped) is recorded in Redis, best effort: a Redis down costs a
sample, never the pass or the session.

A finished cluster without an open attempt never changes again, so a fold adds its figures to
cluster_metric_tally and marks it tallied, in one transaction; a scrape reads the tally and
the untallied clusters' rows in one statement, so each cluster is counted once. Retention
tallies what it deletes, so a counter never goes down.
"""

import hmac
import logging
import time
from collections import Counter

import redis
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From seconds (a free fleet) to a day (a cluster waiting on a busy one).
QUEUED_TO_STARTED_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
# Around GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS (30 by default).
PREPARE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 120)


# In Redis, one HASH per metric; a histogram's buckets are not cumulative (one HINCRBY each).

PASS_KEY = "gradient:metrics:dispatch_pass_seconds"
COUNTERS_KEY = "gradient:metrics:counters"
FORWARDED = "signals_forwarded"
DROPPED = "signals_dropped"
# After a failed write, so that an outage does not cost every pass a connection timeout.
REDIS_BACKOFF_SECS = 10.0
REDIS_TIMEOUT_SECS = 0.5

_clients: dict[str, redis.Redis] = {}
_down_until: dict[str, float] = {}


def _client(url: str) -> redis.Redis:
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_SECS,
            socket_connect_timeout=REDIS_TIMEOUT_SECS,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
    return client


def _record(write) -> None:
    url = settings.REDIS_URL
    if time.monotonic() < _down_until.get(url, 0.0):
        return
    try:
        pipe = _client(url).pipeline()
        write(pipe)
        pipe.execute()
    except Exception as exc:
        _down_until[url] = time.monotonic() + REDIS_BACKOFF_SECS
        log.warning(
            "could not record a metric in Redis (%s); next try in %gs", exc, REDIS_BACKOFF_SECS
        )


def _bucket(value: float, buckets) -> str:
    return floatToGoString(next((b for b in buckets if value <= b), float("inf")))


def observe_dispatch_pass(seconds: float) -> None:
    def write(pipe):
        pipe.hincrby(PASS_KEY, _bucket(seconds, PASS_BUCKETS), 1)
        pipe.hincrbyfloat(PASS_KEY, "sum", seconds)

    _record(write)


def count_signal_forwarded() -> None:
    _record(lambda pipe: pipe.hincrby(COUNTERS_KEY, FORWARDED, 1))


def count_signal_dropped() -> None:
    _record(lambda pipe: pipe.hincrby(COUNTERS_KEY, DROPPED, 1))


# Collecting, at scrape time.


def _cumulative(counts: dict[str, int], buckets) -> list[tuple[str, int]]:
    out, total = [], 0
    for le in [*map(floatToGoString, buckets), "+Inf"]:
        total += counts.get(le, 0)
        out.append((le, total))
    return out


def _histogram_sql(durations_sql: str, buckets) -> str:
    """Count `durations_sql` (rows of label, seconds) into buckets in one aggregate: per label,
    the count, the sum and the count at or under each bucket."""
    filters = ", ".join(f"count(*) FILTER (WHERE s <= {b})" for b in buckets)
    return (
        f"SELECT label, count(*) AS n, coalesce(sum(s), 0) AS total, ARRAY[{filters}] AS le "
        f"FROM ({durations_sql}) AS d GROUP BY label"
    )


def _histograms(rows, buckets) -> dict[str, tuple[list, float]]:
    """`_histogram_sql`'s rows as {label: (cumulative buckets, sum)}."""
    out = {}
    for label, count, total, le in rows:
        pairs = [(floatToGoString(b), n) for b, n in zip(buckets, le, strict=True)]
        out[label] = ([*pairs, ("+Inf", count)], float(total))
    return out


def _empty(buckets) -> tuple[list, float]:
    return _cumulative({}, buckets), 0.0


THESE_CLUSTERS = "cluster_job_id = ANY(%(ids)s)"
UNTALLIED_CLUSTERS = "cluster_job_id = ANY(ARRAY(SELECT id FROM untallied))"

ATTEMPTS_SQL = """
SELECT outcome, finished_at IS NULL AS open, started_at IS NOT NULL AS started, count(*) AS n
FROM cluster_attempt WHERE {scope} GROUP BY 1, 2, 3
"""

# A cluster's wait: created -> its first started attempt (a retry's wait is not counted again).
QUEUED_TO_STARTED_SQL = """
SELECT '' AS label, greatest(0, extract(epoch FROM first.started_at - c.created_at)) AS s
FROM (
    SELECT cluster_job_id, min(started_at) AS started_at FROM cluster_attempt
    WHERE started_at IS NOT NULL AND {scope} GROUP BY cluster_job_id
) AS first
JOIN cluster_job c ON c.id = first.cluster_job_id
"""

# A prepare: attempt created -> started, or -> closed PrepareFailed.
PREPARE_SQL = """
SELECT CASE WHEN started_at IS NOT NULL THEN 'started' ELSE 'failed' END AS label,
       greatest(0, extract(epoch FROM coalesce(started_at, finished_at) - created_at)) AS s
FROM cluster_attempt
WHERE (started_at IS NOT NULL OR outcome = %(prepare_failed)s) AND {scope}
"""

# Tallied metrics: what cluster_metric_tally's `metric` column calls them.
ATTEMPTS, QUEUED_TO_STARTED, PREPARE = "attempts", "queued_to_started", "prepare"
CLUSTERS = "clusters"  # the tallied clusters by status, less those retention deleted


def _json_rows(sql: str) -> str:
    return f"(SELECT coalesce(json_agg(r), '[]') FROM ({sql}) AS r)"


def _figures_sql(scope: str) -> str:
    """Three columns over the attempts of `scope`: ATTEMPTS_SQL's rows and the two histograms'."""
    histograms = (
        (QUEUED_TO_STARTED_SQL, QUEUED_TO_STARTED_BUCKETS),
        (PREPARE_SQL, PREPARE_BUCKETS),
    )
    queries = [ATTEMPTS_SQL, *(_histogram_sql(sql, buckets) for sql, buckets in histograms)]
    return ", ".join(_json_rows(sql.format(scope=scope)) for sql in queries)


FIGURES_SQL = f"SELECT {_figures_sql(THESE_CLUSTERS)}"

# One snapshot: a fold committed meanwhile is counted by the tally or by the rows, once.
SCRAPE_SQL = f"""
WITH untallied AS (SELECT id, status FROM cluster_job WHERE NOT tallied)
SELECT {_json_rows("SELECT metric, series, value FROM cluster_metric_tally")},
       {_json_rows("SELECT status, count(*) AS n FROM untallied GROUP BY status")},
       {_figures_sql(UNTALLIED_CLUSTERS)}
"""


def _read(sql: str, **params) -> tuple:
    """The columns of `sql`'s one row, the last three `_figures_sql`'s read as finished
    attempts by outcome, open ones by phase, and the two histograms."""
    from clusters.models import AttemptOutcome

    with connection.cursor() as cursor:
        cursor.execute(sql, {"prepare_failed": AttemptOutcome.PREPARE_FAILED, **params})
        columns = [[tuple(r.values()) for r in rows] for rows in cursor.fetchone()]
    *others, attempts, waits, prepares = columns
    finished = dict.fromkeys(AttemptOutcome.values, 0)
    open_ = {"preparing": 0, "started": 0}
    for outcome, is_open, started, n in attempts:
        if not is_open:
            finished[outcome] = finished.get(outcome, 0) + n
        else:
            open_["started" if started else "preparing"] += n
    waits = _histograms(waits, QUEUED_TO_STARTED_BUCKETS)
    return *others, finished, open_, waits, _histograms(prepares, PREPARE_BUCKETS)


def _histogram_series(histograms) -> list[tuple[str, float]]:
    out = []
    for label, (pairs, total) in histograms.items():
        out += [(f"{label}|{le}", n) for le, n in pairs]
        out.append((f"{label}|sum", total))
    return out


TALLY_SQL = """
INSERT INTO cluster_metric_tally (metric, series, value) VALUES (%s, %s, %s)
ON CONFLICT (metric, series) DO UPDATE SET value = cluster_metric_tally.value + EXCLUDED.value
"""

# A backlog is folded over several scrapes.
FOLD_BATCH = 10_000

# One that another fold or the retention pass holds is skipped, not waited on.
FOLDABLE_SQL = """
SELECT c.id, c.status FROM cluster_job c
WHERE NOT c.tallied AND c.status = ANY(%(finished)s) AND {no_open_attempt}
ORDER BY c.id LIMIT %(batch)s
FOR UPDATE OF c SKIP LOCKED
"""


def _figures_of(cluster_ids: list[int]) -> Counter:
    """What these clusters' attempts count, as tally rows: {(metric, series): value}."""
    finished, _, waits, prepares = _read(FIGURES_SQL, ids=cluster_ids)
    rows = Counter({(ATTEMPTS, outcome): n for outcome, n in finished.items() if n and outcome})
    rows.update({(QUEUED_TO_STARTED, s): v for s, v in _histogram_series(waits)})
    rows.update({(PREPARE, s): v for s, v in _histogram_series(prepares)})
    return rows


def _add_to_tally(rows: Counter) -> None:
    # In one order, so two transactions adding to the same rows wait, never deadlock.
    values = [(m, s, v) for (m, s), v in sorted(rows.items()) if v]
    if values:
        with connection.cursor() as cursor:
            cursor.executemany(TALLY_SQL, values)


def fold(batch: int = FOLD_BATCH) -> int:
    """Tally up to `batch` finished clusters not yet tallied; how many it tallied."""
    from clusters.models import CLUSTER_TERMINAL, no_open_attempt_sql

    sql = FOLDABLE_SQL.format(no_open_attempt=no_open_attempt_sql("c.id"))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, {"finished": sorted(CLUSTER_TERMINAL), "batch": batch})
        found = cursor.fetchall()
        if not found:
            return 0
        ids = [cluster_id for cluster_id, _ in found]
        cursor.execute("UPDATE cluster_job SET tallied = true WHERE id = ANY(%s)", [ids])
        rows = _figures_of(ids)
        rows.update((CLUSTERS, status) for _, status in found)
        _add_to_tally(rows)
    return len(ids)


def tally_deleted(cluster_ids: list[int]) -> None:
    """Tally the attempts of these clusters not yet tallied, and take the tallied ones off the
    clusters gauge. The retention pass calls this in the transaction that deletes them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, status, tallied FROM cluster_job WHERE id = ANY(%s)", [cluster_ids]
        )
        found = cursor.fetchall()
    rows = _figures_of([cluster_id for cluster_id, _, tallied in found if not tallied])
    rows.subtract((CLUSTERS, status) for _, status, tallied in found if tallied)
    _add_to_tally(rows)


def _with_tally(histogram, label: str, tally, metric: str):
    pairs, total = histogram
    pairs = [(le, n + int(tally.get((metric, f"{label}|{le}"), 0))) for le, n in pairs]
    return pairs, total + tally.get((metric, f"{label}|sum"), 0.0)


def counted(queryset, field: str, labels) -> dict:
    """The rows counted by `field`, every label given (0 when none): no series disappears."""
    counts = dict.fromkeys(labels, 0)
    for row in queryset.order_by().values(field).annotate(n=Count("pk")):
        counts[row[field]] = row["n"]
    return counts


def database_metrics():
    from clusters.models import ClusterStatus
    from gradient.jobs.models import JobKind
    from workers.models import IdleSlot, Worker, idle_slot_fresh_since

    fold()
    tally, by_status, finished, open_, waits, prepares = _read(SCRAPE_SQL)
    tally, by_status = {(m, s): v for m, s, v in tally}, Counter(dict(by_status))
    clusters = GaugeMetricFamily("gradient_clusters", "Cluster jobs by status.", labels=["status"])
    for status in ClusterStatus.values:
        clusters.add_metric([status], by_status[status] + int(tally.get((CLUSTERS, status), 0)))
    yield clusters

    attempts = CounterMetricFamily(
        "gradient_cluster_attempts", "Finished cluster attempts by outcome.", labels=["outcome"]
    )
    for outcome, n in finished.items():
        attempts.add_metric([outcome], n + int(tally.get((ATTEMPTS, outcome), 0)))
    yield attempts
    opened = GaugeMetricFamily(
        "gradient_cluster_attempts_open",
        "Open cluster attempts: preparing (waiting for acceptances) or started.",
        labels=["phase"],
    )
    for phase, n in open_.items():
        opened.add_metric([phase], n)
    yield opened

    queued = HistogramMetricFamily(
        "gradient_cluster_queued_to_started_seconds",
        "Seconds from a cluster's creation to the start of its first started attempt.",
    )
    wait = waits.get("", _empty(QUEUED_TO_STARTED_BUCKETS))
    queued.add_metric([], *_with_tally(wait, "", tally, QUEUED_TO_STARTED))
    yield queued

    prepare = HistogramMetricFamily(
        "gradient_cluster_prepare_seconds",
        "Seconds from an attempt's claim to its start (result=started) or failed prepare.",
        labels=["result"],
    )
    for result in ("started", "failed"):
        figures = prepares.get(result, _empty(PREPARE_BUCKETS))
        prepare.add_metric([result], *_with_tally(figures, result, tally, PREPARE))
    yield prepare

    idle = GaugeMetricFamily(
        "gradient_idle_slots",
        "Idle slots recorded within GRADIENT_IDLE_SLOT_TTL_SECS, by kind.",
        labels=["kind"],
    )
    slots = IdleSlot.objects.filter(recorded_at__gte=idle_slot_fresh_since(timezone.now()))
    for kind, n in counted(slots, "kind", JobKind.values).items():
        idle.add_metric([kind], n)
    yield idle

    yield GaugeMetricFamily(
        "gradient_connected_workers",
        "Workers with a live session.",
        value=Worker.objects.filter(channel_name__isnull=False).count(),
    )
    from gradient.metrics_health import health_metrics

    yield from health_metrics()


def redis_metrics():
    try:
        pipe = _client(settings.REDIS_URL).pipeline()
        pipe.hgetall(PASS_KEY)
        pipe.hgetall(COUNTERS_KEY)
        passes, counters = pipe.execute()
    except Exception as exc:
        log.warning("could not read the metrics kept in Redis (%s)", exc)
        yield GaugeMetricFamily(
            "gradient_metrics_redis_up", "1 when the metrics kept in Redis were read.", value=0
        )
        return
    yield GaugeMetricFamily(
        "gradient_metrics_redis_up", "1 when the metrics kept in Redis were read.", value=1
    )
    buckets = {le: int(n) for le, n in passes.items() if le != "sum"}
    histogram = HistogramMetricFamily(
        "gradient_dispatch_pass_seconds", "Seconds a cluster-dispatch pass took (when it ran)."
    )
    histogram.add_metric([], _cumulative(buckets, PASS_BUCKETS), float(passes.get("sum", 0)))
    yield histogram
    yield CounterMetricFamily(
        "gradient_signals_forwarded",
        "ClusterSignals forwarded within a started attempt.",
        value=int(counters.get(FORWARDED, 0)),
    )
    yield CounterMetricFamily(
        "gradient_signals_dropped",
        "ClusterSignals refused (not_allowed): no started attempt, not a member, no such member.",
        value=int(counters.get(DROPPED, 0)),
    )


class GradientCollector:
    """Everything at scrape time; no describe(), so registering it queries nothing."""

    def collect(self):
        yield from database_metrics()
        yield from redis_metrics()


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(GradientCollector())


def _authorized(request) -> bool:
    token = settings.METRICS_TOKEN
    if not token:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.encode()
    )


@require_safe
def metrics_view(request):
    """GET /metrics. With GRADIENT_METRICS_TOKEN set, only for `Authorization: Bearer <token>`."""
    if not _authorized(request):
        response = HttpResponse("unauthorized\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(REGISTRY), content_type=content_type)
