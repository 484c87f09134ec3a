import django.db.models.deletion
from django.db import migrations, models

from gradient.postgresql.migrations import drop_plain_index

# Django's AlterField to db_index=False drops every index on the column, the unique partial
# ones of Meta.constraints included: the database side drops the foreign key's plain index
# alone.


class Migration(migrations.Migration):
    dependencies = [
        ("clusters", "0008_active_member_triggers"),
        ("jobs", "0009_head_of_every_project"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                drop_plain_index("cluster_member", "evaluation_id"),
                drop_plain_index("cluster_member", "derivation_build_id"),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="clustermember",
                    name="derivation_build",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.DB_CASCADE,
                        related_name="+",
                        to="jobs.derivationbuild",
                    ),
                ),
                migrations.AlterField(
                    model_name="clustermember",
                    name="evaluation",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.DB_CASCADE,
                        related_name="+",
                        to="jobs.evaluation",
                    ),
                ),
            ],
        )
    ]
