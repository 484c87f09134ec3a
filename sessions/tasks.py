from celery import shared_task

from sessions.liveness import disconnect_silent_workers


@shared_task(name="sessions.liveness")
def liveness() -> int:
    return len(disconnect_silent_workers())
