from django.core.management.base import CommandError

from clusters.abort import DEFAULT_REASON, AbortRefused, abort_cluster
from gradient.jobs.management.json_command import JsonCommand, Once


class Command(JsonCommand):
    help = (
        "Abort a cluster job as an evaluation abort would: its open attempt is decided Abort "
        "(running members get AbortJob, held ones AbortCluster) and its member jobs end Aborted."
    )

    def add_arguments(self, parser):
        parser.add_argument("cluster_id", type=int, metavar="ID")
        parser.add_argument(
            "--reason",
            action=Once,
            default=DEFAULT_REASON,
            metavar="TEXT",
            help=f"told to the workers with the abort (default: {DEFAULT_REASON!r})",
        )

    def run(self, *, cluster_id, reason, **options):
        try:
            status = abort_cluster(cluster_id, reason)
        except AbortRefused as e:
            raise CommandError(str(e)) from e
        return {"cluster": cluster_id, "status": status}
