from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("clusters", "0010_metric_fold"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="clusterattempt",
            index=models.Index(fields=["created_at"], name="idx-cluster_attempt-created"),
        ),
    ]
