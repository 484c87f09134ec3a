"""Thin Celery wrappers around the passes."""

from celery import shared_task
from celery.signals import worker_process_init, worker_ready

from clusters.dispatch import run_pass
from clusters.recovery import recover
from clusters.retention import run_retention
from clusters.wake import DISPATCH_TASK, clear_wake
from gradient import heap


@shared_task(name=DISPATCH_TASK, ignore_result=True)
def dispatch(woken: bool = False) -> dict:
    if woken:
        clear_wake()
    result = run_pass(wait=woken)
    return {"claimed": len(result.claimed), "seconds": round(result.seconds, 4)}


@shared_task(name="clusters.recover", ignore_result=True)
def recover_clusters() -> None:
    recover()


@shared_task(name="clusters.retention", ignore_result=True)
def retention() -> int:
    return run_retention()


@worker_ready.connect
def recover_at_start(**_):
    # A restart resumes from the database: overdue prepares, orphaned attempts.
    recover_clusters.delay()


@worker_process_init.connect
def settle_heap(**_):
    # Each pool process, once forked with the tasks' modules loaded.
    heap.settle()
