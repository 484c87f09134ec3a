"""Admin for the existing jobs: read-mostly, as statuses move only by guarded transitions."""

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.utils.functional import cached_property
from django.utils.html import format_html

from gradient.jobs.models import DerivationBuild, DispatchedJob, Evaluation, Project

# An unfiltered list of more rows than this (by PostgreSQL's estimate) shows the estimate.
ESTIMATE_ABOVE = 10_000

# The planner's own estimate of a table's rows: its last ANALYZE's rows per page, times the
# pages it has now; NULL before any ANALYZE.
ESTIMATE_SQL = """
SELECT reltuples / greatest(relpages, 1)
       * (pg_relation_size(oid) / current_setting('block_size')::int)
FROM pg_class WHERE oid = %s::regclass AND reltuples >= 0
"""


class EstimatedCountPaginator(Paginator):
    """An unfiltered list of a large table counted by PostgreSQL's estimate (the list says
    "about"), rather than by reading every row; a filtered one, or a small table, exactly."""

    estimated = False

    @cached_property
    def count(self):
        query = self.object_list.query
        if not query.where:
            with connection.cursor() as cursor:
                cursor.execute(ESTIMATE_SQL, [query.model._meta.db_table])
                row = cursor.fetchone()
            if row and row[0] is not None and row[0] > ESTIMATE_ABOVE:
                self.estimated = True
                return int(row[0])
        return super().count


class HistoryListMixin:
    """A list of rows kept for the whole history: the page costs the same however many are
    kept. No second count of the unfiltered rows beside a filtered list's own."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False


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
class EvaluationAdmin(HistoryListMixin, ViewOnlyMixin, admin.ModelAdmin):
    list_display = ["id", "project", "status", "architecture", "prioritized", "created_at"]
    list_filter = ["status", "prioritized"]
    list_select_related = ["project"]
    search_fields = ["id__exact"]
    readonly_fields = ["id", "created_at", "updated_at"]


@admin.register(DerivationBuild)
class DerivationBuildAdmin(HistoryListMixin, ViewOnlyMixin, admin.ModelAdmin):
    list_display = ["id", "project", "status", "architecture", "prioritized", "created_at"]
    list_filter = ["status", "prioritized", "cache_available"]
    list_select_related = ["project"]
    search_fields = ["id__exact"]
    readonly_fields = ["id", "created_at", "updated_at"]


@admin.register(DispatchedJob)
class DispatchedJobAdmin(HistoryListMixin, ViewOnlyMixin, admin.ModelAdmin):
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
