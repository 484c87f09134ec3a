"""Admin for the existing jobs: read-mostly, as statuses move only by guarded transitions."""

from django.contrib import admin
from django.utils.html import format_html

from gradient.jobs.models import DerivationBuild, DispatchedJob, Evaluation, Project


class ViewOnlyMixin:
    """Rows written only by the scheduler's transactions: the admin shows them, never edits them.

    Works for model admins and inlines alike (an inline's permission checks also take obj).
    """

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]
    search_fields = ["name"]

    def has_delete_permission(self, request, obj=None):
        # Jobs, clusters and assignments reference projects without ON DELETE.
        return False


@admin.register(Evaluation)
class EvaluationAdmin(ViewOnlyMixin, admin.ModelAdmin):
    list_display = ["id", "project", "status", "architecture", "prioritized", "created_at"]
    list_filter = ["status", "prioritized"]
    list_select_related = ["project"]
    search_fields = ["id__exact"]
    readonly_fields = ["id", "created_at", "updated_at"]


@admin.register(DerivationBuild)
class DerivationBuildAdmin(ViewOnlyMixin, admin.ModelAdmin):
    list_display = ["id", "project", "status", "architecture", "prioritized", "created_at"]
    list_filter = ["status", "prioritized", "cache_available"]
    list_select_related = ["project"]
    search_fields = ["id__exact"]
    readonly_fields = ["id", "created_at", "updated_at"]


@admin.register(DispatchedJob)
class DispatchedJobAdmin(ViewOnlyMixin, admin.ModelAdmin):
    list_display = [
        "job_id",
        "kind",
        "worker",
        "cluster_attempt",
        "dispatched_at",
        "finished_at",
        "outcome",
    ]
    list_filter = ["kind", "outcome"]
    list_select_related = ["worker", "cluster_attempt"]
    # Contains, not exact: a bare UUID finds the row without its eval:/build: prefix.
    search_fields = ["job_id"]
    ordering = ["-dispatched_at"]
    # The log tail as the output it is (templates/admin/jobs/dispatchedjob/change_form.html).
    exclude = ["log_tail"]
    readonly_fields = ["id", "output"]

    @admin.display(description="log tail")
    def output(self, row):
        if row.log_tail is None:
            return "-"
        return format_html('<div class="log-tail"><pre>{}</pre></div>', row.log_tail)
