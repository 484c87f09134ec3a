from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "gradient.jobs"
    label = "jobs"
    verbose_name = "Jobs"
