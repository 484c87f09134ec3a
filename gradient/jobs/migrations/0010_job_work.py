"""The work a job carries (command, env, timeout_secs) and what an assignment keeps of its
report (error, log_tail): protocol.md, "Running real work". The new columns take no rewrite
(env's default is a constant); the checks read each job table once, while nothing runs."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0009_head_of_every_project'),
    ]

    operations = [
        migrations.AddField(
            model_name='derivationbuild',
            name='command',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='derivationbuild',
            name='env',
            field=models.JSONField(blank=True, db_default=models.Value({}, models.JSONField()), default=dict),
        ),
        migrations.AddField(
            model_name='derivationbuild',
            name='timeout_secs',
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='dispatchedjob',
            name='error',
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='dispatchedjob',
            name='log_tail',
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='evaluation',
            name='command',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='evaluation',
            name='env',
            field=models.JSONField(blank=True, db_default=models.Value({}, models.JSONField()), default=dict),
        ),
        migrations.AddField(
            model_name='evaluation',
            name='timeout_secs',
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name='derivationbuild',
            constraint=models.CheckConstraint(condition=models.Q(('timeout_secs__isnull', True), models.Q(('timeout_secs__gte', 1), ('timeout_secs__lte', 604800)), _connector='OR'), name='derivation_build-timeout_secs'),
        ),
        migrations.AddConstraint(
            model_name='evaluation',
            constraint=models.CheckConstraint(condition=models.Q(('timeout_secs__isnull', True), models.Q(('timeout_secs__gte', 1), ('timeout_secs__lte', 604800)), _connector='OR'), name='evaluation-timeout_secs'),
        ),
    ]
