import os

from celery import Celery
from celery.signals import task_prerun
from django.db import close_old_connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

app = Celery("gradient")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
def drop_old_connections(sender=None, **_):
    # As Django does around a request. An eager task runs inside its caller's transaction.
    if not getattr(getattr(sender, "request", None), "is_eager", False):
        close_old_connections()
