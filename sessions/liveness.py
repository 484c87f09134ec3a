"""The liveness pass: a worker silent for GRADIENT_WORKER_TIMEOUT_SECS counts as disconnected,
even when the process that served it died without saying so."""

import logging

from django.db import transaction
from django.utils import timezone

from clusters.recovery import report_lost_members
from gradient.logs import ids
from gradient.wire.groups import send_to_worker_on_commit
from sessions.connection import abandon_single_assignments
from workers.liveness import silent_before
from workers.models import Worker

log = logging.getLogger(__name__)


def disconnect_silent_workers(now=None) -> list[int]:
    now = now or timezone.now()
    cutoff = silent_before(now)
    silent = Worker.objects.filter(channel_name__isnull=False, last_seen_at__lt=cutoff)
    gone = []
    for worker_id in silent.values_list("pk", flat=True):
        with transaction.atomic(durable=True):
            # Re-checked under the update: a frame that arrived meanwhile keeps it connected.
            if Worker.objects.filter(
                pk=worker_id, channel_name__isnull=False, last_seen_at__lt=cutoff
            ).update(channel_name=None):
                abandon_single_assignments(worker_id)
                # If a session still holds the socket somewhere, it closes it.
                send_to_worker_on_commit(worker_id, {"type": "worker.silent"})
                gone.append(worker_id)
        if gone and gone[-1] == worker_id:
            report_lost_members(worker_id)
    if gone:
        log.info("disconnected %d silent worker(s): %s", len(gone), gone, extra=ids(worker=gone))
    return gone
