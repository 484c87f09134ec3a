from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("clusters", "0009_redundant_fk_indexes"),
        ("jobs", "0010_job_work"),
    ]

    operations = [
        migrations.AddField(
            model_name="clusterjob",
            name="tallied",
            field=models.BooleanField(db_default=False, default=False, editable=False),
        ),
        migrations.AddIndex(
            model_name="clusterjob",
            index=models.Index(
                condition=models.Q(("tallied", False)),
                fields=["id"],
                name="idx-cluster_job-untallied",
            ),
        ),
    ]
