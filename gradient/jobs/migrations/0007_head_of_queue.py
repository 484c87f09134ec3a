"""The head of the queue (protocol.md): offers and the single path read each kind's first
GRADIENT_OFFER_WINDOW jobs from an index in the single path's order, so the watermark that
read only the rows written since a session's last offer (written_xid, migration 0006) goes.
active_member (kept by clusters migration 0005's triggers) becomes a model field, so that the
head's indexes can leave members out; passed_over counts how often a job first in line was
passed over by a younger one."""

from django.db import migrations, models
from django.db.models import Q

WRITTEN_XID = """
CREATE FUNCTION job_written_xid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.written_xid := pg_current_xact_id();
    RETURN NEW;
END $$
"""


def drop_written_xid(table: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        f'DROP TRIGGER {table}_written_xid ON {table}; DROP INDEX "idx-{table}-written";'
        f" ALTER TABLE {table} DROP COLUMN written_xid",
        f"ALTER TABLE {table} ADD COLUMN written_xid xid8 NOT NULL DEFAULT '0';"
        f" CREATE TRIGGER {table}_written_xid BEFORE INSERT OR UPDATE ON {table}"
        " FOR EACH ROW EXECUTE FUNCTION job_written_xid();"
        f' CREATE INDEX "idx-{table}-written" ON {table} (written_xid)',
    )


def shown(model: str) -> migrations.SeparateDatabaseAndState:
    # The column and its triggers exist already (clusters migration 0005).
    return migrations.SeparateDatabaseAndState(
        state_operations=[
            migrations.AddField(
                model_name=model,
                name="active_member",
                field=models.BooleanField(default=False, db_default=False, editable=False),
            )
        ]
    )


def passed_over(model: str) -> migrations.AddField:
    return migrations.AddField(
        model_name=model,
        name="passed_over",
        field=models.PositiveSmallIntegerField(default=0, db_default=0, editable=False),
    )


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_written_xid"),
        ("clusters", "0005_active_member"),
    ]

    operations = [
        drop_written_xid("evaluation"),
        drop_written_xid("derivation_build"),
        migrations.RunSQL("DROP FUNCTION job_written_xid()", WRITTEN_XID),
        shown("evaluation"),
        shown("derivationbuild"),
        passed_over("evaluation"),
        passed_over("derivationbuild"),
        migrations.RemoveIndex(model_name="evaluation", name="idx-evaluation-startable"),
        migrations.RemoveIndex(model_name="derivationbuild", name="idx-derivation_build-queued"),
        migrations.AddIndex(
            model_name="evaluation",
            index=models.Index(
                fields=["architecture", "-prioritized", "created_at"],
                name="idx-evaluation-head",
                condition=Q(status__in=["Queued", "Fetching"], active_member=False),
            ),
        ),
        migrations.AddIndex(
            model_name="evaluation",
            index=models.Index(
                fields=["project", "architecture", "-prioritized", "created_at"],
                name="idx-evaluation-head-proj",
                condition=Q(status__in=["Queued", "Fetching"], active_member=False),
            ),
        ),
        migrations.AddIndex(
            model_name="derivationbuild",
            index=models.Index(
                fields=["architecture", "-prioritized", "created_at"],
                name="idx-derivation_build-head",
                condition=Q(status="Queued", active_member=False),
            ),
        ),
        migrations.AddIndex(
            model_name="derivationbuild",
            index=models.Index(
                fields=["project", "architecture", "-prioritized", "created_at"],
                name="idx-derivation_build-head-proj",
                condition=Q(status="Queued", active_member=False),
            ),
        ),
    ]
