from django.core.management.base import CommandError

from clusters.history import describe_cluster
from clusters.models import ClusterJob
from gradient.jobs.management.json_command import JsonCommand


class Command(JsonCommand):
    help = "Print one cluster job: its members and its attempts, oldest first, with their seats."

    def add_arguments(self, parser):
        parser.add_argument("cluster_id", type=int, metavar="ID")

    def run(self, *, cluster_id, **options):
        cluster = ClusterJob.objects.filter(pk=cluster_id).first()
        if cluster is None:
            raise CommandError(f"unknown cluster {cluster_id}")
        return describe_cluster(cluster)
