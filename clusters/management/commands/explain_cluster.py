from django.core.management.base import CommandError

from clusters.explain import explain
from clusters.models import ClusterJob
from gradient.jobs.management.json_command import JsonCommand


class Command(JsonCommand):
    help = (
        "Why a cluster waits: for each member, the workers that could seat it and why each "
        "other connected worker cannot."
    )

    def add_arguments(self, parser):
        parser.add_argument("cluster_id", type=int, metavar="ID")

    def run(self, *, cluster_id, **options):
        try:
            return explain(cluster_id)
        except ClusterJob.DoesNotExist:
            raise CommandError(f"unknown cluster {cluster_id}") from None
