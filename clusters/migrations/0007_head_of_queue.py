"""The head of the queue (protocol.md): a cluster's priority as a column (the members' part of
the head walks the waiting clusters in the planner's order, by an index), when the dispatch
pass offered its members to the idle seats, and pinned members found by their pin."""

from django.db import migrations, models
from django.db.models import Q

# Clusters submitted before: prioritized when any member job is.
BACKFILL = """
UPDATE cluster_job c SET prioritized = true
WHERE EXISTS (SELECT 1 FROM cluster_member m
              LEFT JOIN evaluation e ON e.id = m.evaluation_id
              LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
              WHERE m.cluster_job_id = c.id AND coalesce(e.prioritized, b.prioritized))
"""


class Migration(migrations.Migration):
    dependencies = [
        ("clusters", "0006_waiting_since"),
        ("jobs", "0007_head_of_queue"),
    ]

    operations = [
        migrations.AddField(
            model_name="clusterjob",
            name="prioritized",
            field=models.BooleanField(default=False, db_default=False),
        ),
        migrations.AddField(
            model_name="clusterjob",
            name="offered_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.RemoveIndex(model_name="clusterjob", name="idx-cluster_job-waiting"),
        migrations.AddIndex(
            model_name="clusterjob",
            index=models.Index(
                fields=["-prioritized", "created_at", "id"],
                condition=Q(waiting_since__isnull=False),
                name="idx-cluster_job-waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="clusterjob",
            index=models.Index(
                fields=["project", "-prioritized", "created_at", "id"],
                condition=Q(waiting_since__isnull=False),
                name="idx-cluster_job-waiting-proj",
            ),
        ),
        migrations.AddIndex(
            model_name="clustermember",
            index=models.Index(
                fields=["pin"], condition=Q(pin__isnull=False), name="idx-cluster_member-pin"
            ),
        ),
    ]
