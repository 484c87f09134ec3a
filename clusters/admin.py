"""Cluster jobs and their attempts, read-only: `submit_cluster` creates them, passes move them.
The cluster page's content is clusters.cluster_page; here, the lists, filters and the abort."""

from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.postgres.expressions import ArraySubquery
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Exists, OuterRef, Subquery, Value
from django.db.models.functions import Coalesce
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html

from clusters.abort import MAX_REASON_CHARS, AbortRefused, abort_cluster
from clusters.cluster_page import OPEN, OUTCOME_COLOURS, outcome_label, overview
from clusters.models import (
    CLUSTER_TERMINAL,
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
)
from gradient.jobs.admin import HistoryListMixin, ViewOnlyMixin
from gradient.jobs.models import DispatchedJob
from workers.models import Worker

# The list: filters and columns, each from an annotation (no query per row).


class SeatZoneFilter(admin.SimpleListFilter):
    """Clusters that seated a member in the zone (the worker's zone as last reported)."""

    title = "seat zone"
    parameter_name = "zone"
    NO_ZONE = "-"

    def lookups(self, request, model_admin):
        zones = Worker.objects.exclude(zone=None).order_by("zone").values_list("zone", flat=True)
        return [*((z, z) for z in zones.distinct()), (self.NO_ZONE, "no zone")]

    def queryset(self, request, queryset):
        if self.value() is None:
            return queryset
        rows = DispatchedJob.objects.filter(cluster_attempt__cluster_job=OuterRef("pk"))
        if self.value() == self.NO_ZONE:
            rows = rows.filter(worker__zone=None)
        else:
            rows = rows.filter(worker__zone=self.value())
        return queryset.filter(Exists(rows))


class AgeFilter(admin.SimpleListFilter):
    """By creation: within the last hour, day or week, or older than a week."""

    title = "age"
    parameter_name = "age"
    WITHIN = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}

    def lookups(self, request, model_admin):
        return [
            ("hour", "Last hour"),
            ("day", "Last 24 hours"),
            ("week", "Last 7 days"),
            ("older", "Older than 7 days"),
        ]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() in self.WITHIN:
            return queryset.filter(created_at__gte=now - self.WITHIN[self.value()])
        if self.value() == "older":
            return queryset.filter(created_at__lt=now - self.WITHIN["week"])
        return queryset


def swatch(colour: str):
    return format_html(
        '<svg class="swatch" width="10" height="10" aria-hidden="true">'
        '<circle cx="5" cy="5" r="5" fill="{}"/></svg>',
        colour,
    )


class AbortForm(forms.Form):
    reason = forms.CharField(
        max_length=MAX_REASON_CHARS,
        required=False,
        help_text="Told to the workers with the abort.",
        widget=forms.TextInput(attrs={"size": 60}),
    )


@admin.register(ClusterJob)
class ClusterJobAdmin(HistoryListMixin, ViewOnlyMixin, admin.ModelAdmin):
    list_display = [
        "id",
        "project",
        "status",
        "last_attempt",
        "seat_zones",
        "same_zone",
        "attempts",
        "retry_budget",
        "member_count",
        "created_at",
    ]
    list_filter = ["status", SeatZoneFilter, "same_zone", AgeFilter]
    list_select_related = ["project"]
    search_fields = ["id__exact", "members__role"]
    ordering = ["-id"]
    # Three lines of fields, so the members and the attempts below show without scrolling.
    fieldsets = [
        (
            None,
            {
                "fields": [
                    ("id", "project", "status"),
                    ("same_zone", "attempts", "retry_budget"),
                    ("created_at", "updated_at"),
                ]
            },
        )
    ]
    readonly_fields = [f for line in fieldsets[0][1]["fields"] for f in line]
    actions = ["abort_selected"]

    def has_abort_permission(self, request):
        # The form stays read-only; aborting is for staff holding the model's change permission.
        user = request.user
        return user.is_active and user.is_staff and user.has_perm("clusters.change_clusterjob")

    @admin.action(description="Abort selected clusters", permissions=["abort"])
    def abort_selected(self, request, queryset):
        if not self.has_abort_permission(request):
            raise PermissionDenied
        clusters = list(queryset.select_related("project").order_by("pk"))
        form = AbortForm(request.POST if request.POST.get("post") == "yes" else None)
        if not form.is_valid():  # the confirmation page, or its form again with the error
            context = {
                **self.admin_site.each_context(request),
                "title": "Abort clusters: are you sure?",
                "opts": self.opts,
                "media": self.media,
                "clusters": [(c, c.status in CLUSTER_TERMINAL) for c in clusters],
                "form": form,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/clusters/clusterjob/abort_selected_confirmation.html", context
            )
        reason = form.cleaned_data["reason"] or f"aborted by {request.user.get_username()}"
        aborted, skipped = [], []
        for cluster in clusters:
            try:
                abort_cluster(cluster.pk, reason)
            except AbortRefused as refused:  # finished, or finished meanwhile: nothing changed
                skipped.append(str(refused))
            else:
                aborted.append(str(cluster.pk))
        if aborted:
            self.message_user(request, f"Aborted cluster(s) {', '.join(aborted)}.")
        if skipped:
            self.message_user(request, f"Skipped: {'; '.join(skipped)}.", messages.WARNING)
        return None  # back to the list

    def get_queryset(self, request):
        attempts = ClusterAttempt.objects.filter(cluster_job=OuterRef("pk"))
        seats = DispatchedJob.objects.filter(cluster_attempt__cluster_job=OuterRef("pk"))
        # Subqueries, never a join and GROUP BY: a count of the list then reads no annotation,
        # and a search by role (a join of members) cannot multiply the member count.
        members = (
            ClusterMember.objects.filter(cluster_job=OuterRef("pk"))
            .order_by()
            .values("cluster_job")
            .annotate(n=Count("pk"))
            .values("n")
        )
        return (
            super()
            .get_queryset(request)
            .annotate(
                num_members=Coalesce(Subquery(members), 0),
                last_state=Subquery(
                    attempts.order_by("-created_at", "-id")
                    .annotate(state=Coalesce("outcome", Value(OPEN)))
                    .values("state")[:1]
                ),
                zones_used=ArraySubquery(
                    seats.order_by("worker__zone").values("worker__zone").distinct()
                ),
            )
        )

    @admin.display(description="members", ordering="num_members")
    def member_count(self, cluster):
        return cluster.num_members

    @admin.display(description="last attempt")
    def last_attempt(self, cluster):
        if cluster.last_state is None:
            return "-"
        state = cluster.last_state
        return format_html("{} {}", swatch(OUTCOME_COLOURS[state]), outcome_label(state))

    @admin.display(description="seat zones")
    def seat_zones(self, cluster):
        return ", ".join("no zone" if z is None else z for z in cluster.zones_used) or "-"

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None:
            context["overview"] = overview(obj)
        return super().render_change_form(request, context, add, change, form_url, obj)


class DispatchedInline(ViewOnlyMixin, admin.TabularInline):
    model = DispatchedJob
    fields = ["job_id", "worker", "dispatched_at", "finished_at", "outcome"]
    ordering = ["dispatched_at"]

    def get_queryset(self, request):
        # The worker column links to each worker: fetch them with the rows.
        return super().get_queryset(request).select_related("worker")


@admin.register(ClusterAttempt)
class ClusterAttemptAdmin(HistoryListMixin, ViewOnlyMixin, admin.ModelAdmin):
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
