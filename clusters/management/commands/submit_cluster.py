import sys

from django.core.management.base import CommandError

from clusters.document import submit_document
from clusters.submission import parse_member, submit_cluster
from gradient.jobs.management.json_command import JsonCommand, Once
from gradient.jobs.submission import SubmissionError

# What a document holds instead: beside --file, each of these is refused.
CLUSTER_OPTIONS = ("project", "same_zone", "retry_budget", "prioritized", "member")


class Command(JsonCommand):
    help = (
        "Create a cluster job and its member jobs in one transaction, from --project and"
        " --member options or from one JSON document (--file)."
        ' Prints {"cluster": ID, "members": [{"role", "job_id"}]}.'
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--file",
            action=Once,
            metavar="PATH",
            help="the whole cluster as one JSON document (- reads standard input)",
        )
        parser.add_argument("--project", action=Once, metavar="P")
        # No defaults here (None), so that beside --file an option given is told from one
        # left out; run() applies the defaults.
        parser.add_argument("--same-zone", action=Once, nargs=0, const=True)
        parser.add_argument("--retry-budget", action=Once, type=int, metavar="N")
        parser.add_argument(
            "--prioritized",
            action=Once,
            nargs=0,
            const=True,
            help="mark every member job prioritized",
        )
        parser.add_argument(
            "--member",
            action="append",
            metavar="SPEC",
            help="ROLE:KIND[:primary][:pin=WORKER][:arch=ARCH][:features=F1+F2][:paths=P1+P2]",
        )

    def run(self, *, file, **options):
        try:
            if file is None:
                cluster, rows = self.from_options(**options)
            else:
                beside = [name for name in CLUSTER_OPTIONS if options[name] is not None]
                if beside:
                    option = self.labels[beside[0]]
                    raise CommandError(f"--file takes the whole cluster; {option} goes in it")
                cluster, rows = submit_document(read(file))
        except SubmissionError as e:
            # A document's refusal names its field; a --member's names its SPEC.
            raise CommandError(str(e) if file is None else e.line()) from None
        return {
            "cluster": cluster.pk,
            "members": [{"role": row.role, "job_id": row.job_key} for row in rows],
        }

    def from_options(self, *, project, same_zone, retry_budget, prioritized, member, **options):
        if project is None:
            raise CommandError("the following arguments are required: --project (or --file)")
        return submit_cluster(
            project,
            [parse_member(spec) for spec in member or []],
            same_zone=bool(same_zone),
            retry_budget=0 if retry_budget is None else retry_budget,
            prioritized=bool(prioritized),
        )


def read(path: str) -> bytes:
    try:
        if path == "-":
            return sys.stdin.buffer.read()
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CommandError(f"--file: cannot read {path}: {e.strerror}") from None
