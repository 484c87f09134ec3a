"""/metrics' worker health series: the workers quarantined now, and the blamed seats, whose
dispatched_job rows outlive their attempts, so the counter never goes down."""

from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gradient.metrics import counted


def health_metrics():
    from clusters.blame import BLAMES
    from gradient.jobs.models import DispatchedJob
    from workers.health import AUTOMATIC, OPERATOR, quarantined_q
    from workers.models import Worker

    quarantined = GaugeMetricFamily(
        "gradient_quarantined_workers",
        "Workers quarantined from cluster members now, by whom (operator or automatic).",
        labels=["by"],
    )
    now_quarantined = Worker.objects.filter(quarantined_q(timezone.now()))
    for who, n in counted(now_quarantined, "quarantined_by", (AUTOMATIC, OPERATOR)).items():
        quarantined.add_metric([who], n)
    yield quarantined
    blamed = CounterMetricFamily(
        "gradient_blamed_seats",
        "Cluster seats blamed for ending their attempt, by how.",
        labels=["blame"],
    )
    seats = DispatchedJob.objects.filter(blame__isnull=False)
    for how, n in counted(seats, "blame", BLAMES).items():
        blamed.add_metric([how], n)
    yield blamed
