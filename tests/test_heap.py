"""The service's processes set the garbage collector up once started (gradient.heap): the web
process when its ASGI application is loaded, each Celery pool process when it is forked.
Checked in a fresh interpreter each: tuning the test process itself would prove nothing."""

import os
import subprocess
import sys
from pathlib import Path

from gradient import heap

ROOT = Path(__file__).resolve().parent.parent
REPORT = "import gc; print(gc.get_threshold(), gc.get_freeze_count() > 0)"
TUNED = f"{(heap.YOUNG, heap.OLDER, heap.OLDER)} True"


def run(code: str) -> str:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "gradient.settings"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_fresh_interpreter_has_the_defaults():
    assert run(REPORT) != TUNED


def test_the_web_process_tunes_its_heap_once_its_application_is_loaded():
    assert run("import gradient.asgi; " + REPORT) == TUNED


def test_each_celery_pool_process_tunes_its_heap_when_forked():
    code = (
        "import django; django.setup(); import clusters.tasks;"
        " from celery.signals import worker_process_init;"
        " worker_process_init.send(sender=None); " + REPORT
    )
    assert run(code) == TUNED
