"""Thin Celery wrappers around the passes."""

from celery import shared_task
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready

from clusters.dispatch import run_pass
from clusters.recovery import recover
from clusters.retention import run_retention
from clusters.wake import DISPATCH_TASK, clear_wake
from gradient import heap
from gradient.wire.groups import drain_sends


@shared_task(name=DISPATCH_TASK, ignore_result=True)
def dispatch(woken: bool = False) -> dict:
    if woken:
        clear_wake()
    result = run_pass(wait=woken)
    # Logged by Celery: enough to tell a pass without seats from one holding clusters.
    return {
        "claimed": len(result.claimed),
        "ready": result.ready,
        "placed": result.placed,
        "held": result.held,
        "reservation": result.reservation,
        "seconds": round(result.seconds, 4),
    }


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


@worker_init.connect
def load_solver(**_):
    # scipy.optimize is slow to import: once here, before the pool forks.
    import scipy.optimize  # noqa: F401


@worker_process_init.connect
def tune_heap(**_):
    # Each pool process, once forked with the tasks' modules loaded.
    heap.tune()


@worker_process_shutdown.connect
def finish_sends(**_):
    # A pass sends its frames without waiting for them: let them leave before the exit.
    drain_sends(5.0)
