from django.core.management.base import CommandError
from django.db import IntegrityError, transaction

from gradient.jobs.management.json_command import JsonCommand, checked_name
from gradient.jobs.models import Project


class Command(JsonCommand):
    help = 'Create a project. Prints {"project": NAME}.'

    def add_arguments(self, parser):
        parser.add_argument("name", metavar="NAME")

    def run(self, *, name, **options):
        name = checked_name(Project, name, "project")
        if Project.objects.filter(name=name).exists():
            raise CommandError(f"project {name!r} already exists")
        try:
            with transaction.atomic(durable=True):
                Project.objects.create(name=name)
        except IntegrityError:  # created by someone else since the check
            raise CommandError(f"project {name!r} already exists") from None
        return {"project": name}
