from django.core.management.base import CommandError

from clusters.worker_view import describe_worker
from gradient.jobs.management.json_command import JsonCommand
from workers.models import Worker


class Command(JsonCommand):
    help = (
        "Print one worker: its connection, its quarantine, and its recent cluster seats (newest"
        " first, at most 20) with whether each was blamed for ending its attempt."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", metavar="NAME")

    def run(self, *, name, **options):
        worker = Worker.objects.filter(name=name).first()
        if worker is None:
            raise CommandError(f"unknown worker {name!r}")
        return describe_worker(worker)
