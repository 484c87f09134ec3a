"""Cluster jobs and their attempts, read-only: `submit_cluster` creates them, passes move them."""

from django.contrib import admin
from django.db.models import Count

from clusters.models import ClusterAttempt, ClusterJob, ClusterMember
from gradient.jobs.admin import ViewOnlyMixin
from gradient.jobs.models import DispatchedJob


class MemberInline(ViewOnlyMixin, admin.TabularInline):
    model = ClusterMember
    fields = ["role", "job_key", "primary", "pin"]
    readonly_fields = ["job_key"]


class AttemptInline(ViewOnlyMixin, admin.TabularInline):
    model = ClusterAttempt
    fields = ["id", "created_at", "started_at", "finished_at", "outcome"]
    readonly_fields = ["id"]
    show_change_link = True


@admin.register(ClusterJob)
class ClusterJobAdmin(ViewOnlyMixin, admin.ModelAdmin):
    list_display = [
        "id",
        "project",
        "status",
        "same_zone",
        "attempts",
        "retry_budget",
        "member_count",
        "created_at",
    ]
    list_filter = ["status", "same_zone"]
    list_select_related = ["project"]
    search_fields = ["id__exact", "members__role"]
    ordering = ["-id"]
    fields = readonly_fields = [
        "id",
        "project",
        "status",
        "same_zone",
        "attempts",
        "retry_budget",
        "created_at",
        "updated_at",
    ]
    inlines = [MemberInline, AttemptInline]

    def get_queryset(self, request):
        # distinct: a search by role joins members a second time and would multiply the count.
        return super().get_queryset(request).annotate(num_members=Count("members", distinct=True))

    @admin.display(description="members", ordering="num_members")
    def member_count(self, cluster):
        return cluster.num_members


class DispatchedInline(ViewOnlyMixin, admin.TabularInline):
    model = DispatchedJob
    fields = ["job_id", "worker", "dispatched_at", "finished_at", "outcome"]
    ordering = ["dispatched_at"]

    def get_queryset(self, request):
        # The worker column links to each worker: fetch them with the rows.
        return super().get_queryset(request).select_related("worker")


@admin.register(ClusterAttempt)
class ClusterAttemptAdmin(ViewOnlyMixin, admin.ModelAdmin):
    list_display = ["id", "cluster_job", "created_at", "started_at", "finished_at", "outcome"]
    list_filter = ["outcome"]
    list_select_related = ["cluster_job"]
    search_fields = ["id__exact", "cluster_job__id__exact"]
    ordering = ["-created_at"]
    fields = readonly_fields = [
        "id",
        "cluster_job",
        "created_at",
        "started_at",
        "finished_at",
        "outcome",
    ]
    inlines = [DispatchedInline]
