from django.apps import AppConfig


class SessionsConfig(AppConfig):
    """Installed so that Celery finds sessions.tasks. No models; the label is not `sessions`,
    which django.contrib.sessions owns."""

    name = "sessions"
    label = "worker_sessions"
    verbose_name = "Worker sessions"
