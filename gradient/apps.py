from django.apps import AppConfig


class GradientConfig(AppConfig):
    """The project itself as an app (no models): every process that sets Django up loads the
    Celery app here, so the shared_tasks of clusters and sessions bind to it, not a default."""

    name = "gradient"
    verbose_name = "Gradient"

    def ready(self):
        from gradient import celery  # noqa: F401
