"""The Celery app is loaded by Django's set-up, not by importing the project package: the
shared tasks still bind to it in every process that sets Django up."""

import subprocess
import sys

from clusters.tasks import dispatch
from gradient.celery import app
from sessions.tasks import liveness


def test_the_shared_tasks_bind_to_the_projects_app():
    assert dispatch.app is app and liveness.app is app
    assert {"clusters.dispatch", "sessions.liveness"} <= set(app.tasks)


def test_celery_finds_the_app_from_the_package_name():
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "from celery.app.utils import find_app; print(find_app('gradient').main)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "gradient"
