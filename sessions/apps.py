from django.apps import AppConfig


class SessionsConfig(AppConfig):
    """Installed so that Celery finds sessions.tasks; not labelled `sessions` (django.contrib's)."""

    name = "sessions"
    label = "worker_sessions"
    verbose_name = "Worker sessions"
