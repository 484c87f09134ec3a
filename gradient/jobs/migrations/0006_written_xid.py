"""Each job row's last writing transaction as a 64-bit xid (xid8), set by a trigger, and
indexed: the offers read only the job rows written since a session's last offer, and a system
column (xmin) cannot be indexed, so that read scanned every startable job on every RequestJob
(docs/design.md). Not a model field: only SQL reads it, and the trigger writes it on every
INSERT and UPDATE, whoever writes the row."""

from django.db import migrations

FUNCTION = """
CREATE FUNCTION job_written_xid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.written_xid := pg_current_xact_id();
    RETURN NEW;
END $$
"""


def table(name: str) -> list[migrations.RunSQL]:
    return [
        migrations.RunSQL(
            f"ALTER TABLE {name} ADD COLUMN written_xid xid8 NOT NULL DEFAULT '0'",
            f"ALTER TABLE {name} DROP COLUMN written_xid",
        ),
        migrations.RunSQL(
            f"CREATE TRIGGER {name}_written_xid BEFORE INSERT OR UPDATE ON {name}"
            " FOR EACH ROW EXECUTE FUNCTION job_written_xid()",
            f"DROP TRIGGER {name}_written_xid ON {name}",
        ),
        migrations.RunSQL(
            f'CREATE INDEX "idx-{name}-written" ON {name} (written_xid)',
            f'DROP INDEX "idx-{name}-written"',
        ),
    ]


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_evaluation_startable_index"),
    ]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION job_written_xid()"),
        *table("evaluation"),
        *table("derivation_build"),
    ]
