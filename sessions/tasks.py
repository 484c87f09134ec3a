from celery import shared_task

from workers.liveness import disconnect_silent_workers


@shared_task(name="workers.liveness")
def liveness() -> int:
    return len(disconnect_silent_workers())
