from celery import shared_task

from workers import pruning
from workers.liveness import disconnect_silent_workers


@shared_task(name="workers.liveness")
def liveness() -> int:
    return len(disconnect_silent_workers())


@shared_task(name="workers.prune_scores")
def prune_scores() -> int:
    return pruning.prune_scores()
