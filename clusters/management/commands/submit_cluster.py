from django.core.management.base import CommandError

from clusters.submission import parse_member, submit_cluster
from gradient.jobs.management.json_command import JsonCommand, Once
from gradient.jobs.submission import SubmissionError


class Command(JsonCommand):
    help = (
        "Create a cluster job and its member jobs in one transaction."
        ' Prints {"cluster": ID, "members": [{"role", "job_id"}]}.'
    )

    def add_arguments(self, parser):
        parser.add_argument("--project", action=Once, required=True, metavar="P")
        parser.add_argument("--same-zone", action=Once, nargs=0, const=True, default=False)
        parser.add_argument("--retry-budget", action=Once, type=int, default=0, metavar="N")
        parser.add_argument(
            "--prioritized",
            action=Once,
            nargs=0,
            const=True,
            default=False,
            help="mark every member job prioritized",
        )
        parser.add_argument(
            "--member",
            action="append",
            default=[],
            metavar="SPEC",
            help="ROLE:KIND[:primary][:pin=WORKER][:arch=ARCH][:features=F1+F2][:paths=P1+P2]",
        )

    def run(self, *, project, same_zone, retry_budget, prioritized, member, **options):
        try:
            members = [parse_member(spec) for spec in member]
            cluster, rows = submit_cluster(
                project,
                members,
                same_zone=same_zone,
                retry_budget=retry_budget,
                prioritized=prioritized,
            )
        except SubmissionError as e:
            raise CommandError(str(e)) from None
        return {
            "cluster": cluster.pk,
            "members": [{"role": row.role, "job_id": row.job_key} for row in rows],
        }
