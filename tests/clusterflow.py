"""Shared set-up for cluster-flow tests: connected workers with idle slots, frames captured
from the channel layer."""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from clusters.coordinator import accept_assignment
from gradient.jobs.models import DispatchedJob
from tests.factories import WorkerFactory
from workers.groups import worker_group
from workers.models import IdleSlot


def idle_workers(n, kinds=("eval", "build"), **fields):
    now = timezone.now()
    workers = []
    for _ in range(n):
        worker = WorkerFactory(channel_name="live", last_seen_at=now, **fields)
        for kind in kinds:
            IdleSlot.objects.create(worker=worker, kind=kind, recorded_at=now)
        workers.append(worker)
    return workers


class Inbox:
    """Listens on the groups of some workers, as their sessions would."""

    def __init__(self, workers):
        self.layer = get_channel_layer()
        self.channels = {}
        for w in workers:
            channel = async_to_sync(self.layer.new_channel)()
            async_to_sync(self.layer.group_add)(worker_group(w.pk), channel)
            self.channels[w.pk] = channel

    def frames(self, worker) -> list[dict]:
        import json

        out = []
        while True:
            try:
                message = async_to_sync(self._receive)(self.channels[worker.pk])
            except TimeoutError:
                return out
            out.append(json.loads(message["frame"]))

    async def _receive(self, channel):
        import asyncio

        return await asyncio.wait_for(self.layer.receive(channel), 0.05)


def accept_every_member(attempt_id) -> list:
    """Each member of the attempt accepts its assignment, in row order, as its worker would
    (coordinator.accept_assignment): the last acceptance starts the attempt. What each
    returned: True for the one that started it."""
    rows = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).order_by("id")
    return [accept_assignment(r.worker_id, r.job_id) for r in rows]
