"""Cluster jobs and their attempts, read-only: `submit_cluster` creates them, passes move them."""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.template.response import TemplateResponse

from clusters.abort import MAX_REASON_CHARS, AbortRefused, abort_cluster
from clusters.models import CLUSTER_TERMINAL, ClusterAttempt, ClusterJob, ClusterMember
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


class AbortForm(forms.Form):
    reason = forms.CharField(
        max_length=MAX_REASON_CHARS,
        required=False,
        help_text="Told to the workers with the abort.",
        widget=forms.TextInput(attrs={"size": 60}),
    )


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
    actions = ["abort_selected"]

    def has_abort_permission(self, request):
        # The form stays read-only (no change permission through the admin); aborting, which
        # goes through the verdict path, is for staff holding the model's change permission.
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
