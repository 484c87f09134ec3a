"""The heads' indexes over every project take a condition that only the walk over every
project states (models.EVERY_PROJECT): a walk of one project then reads its own index, instead
of the one over every project filtered by project, which PostgreSQL chose and which read
another project's whole queue to find that this one had none."""

from django.db import migrations, models
from django.db.models import Q

FIELDS = ["architecture", "-prioritized", "created_at"]
EVERY_PROJECT = Q(created_at__isnull=False)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0008_worker_health"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="derivationbuild", name="idx-derivation_build-head"),
        migrations.RemoveIndex(model_name="evaluation", name="idx-evaluation-head"),
        migrations.AddIndex(
            model_name="derivationbuild",
            index=models.Index(
                fields=FIELDS,
                name="idx-derivation_build-head",
                condition=Q(status="Queued", active_member=False) & EVERY_PROJECT,
            ),
        ),
        migrations.AddIndex(
            model_name="evaluation",
            index=models.Index(
                fields=FIELDS,
                name="idx-evaluation-head",
                condition=Q(status__in=["Queued", "Fetching"], active_member=False)
                & EVERY_PROJECT,
            ),
        ),
    ]
