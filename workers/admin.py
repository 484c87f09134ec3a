"""Workers: `create_worker` creates them (showing the token once); the hash is never shown."""

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.postgres.expressions import ArraySubquery
from django.core.exceptions import PermissionDenied
from django.db.models import F, Func, IntegerField, OuterRef
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join

from gradient.jobs.models import DispatchedJob
from workers import health
from workers.models import IdleSlot, Worker, idle_slot_fresh_since

EDITABLE = ["revoked_at", "all_projects", "projects"]
# Open assignments named in the list; the rest are counted.
KEYS_SHOWN = 3


class HealthFilter(admin.SimpleListFilter):
    title = "health"
    parameter_name = "health"

    def lookups(self, request, model_admin):
        return [("quarantined", "Quarantined"), ("healthy", "Not quarantined")]

    def queryset(self, request, queryset):
        quarantined = health.quarantined_q(timezone.now())
        if self.value() == "quarantined":
            return queryset.filter(quarantined)
        if self.value() == "healthy":
            return queryset.exclude(quarantined)
        return queryset


class ConnectionFilter(admin.SimpleListFilter):
    title = "connection"
    parameter_name = "connection"

    def lookups(self, request, model_admin):
        return [("connected", "Connected"), ("disconnected", "Disconnected")]

    def queryset(self, request, queryset):
        if self.value() in ("connected", "disconnected"):
            return queryset.filter(channel_name__isnull=self.value() == "disconnected")
        return queryset


def short_key(job_id: str) -> str:
    kind, _, uuid = job_id.partition(":")
    return f"{kind}:{uuid[:8]}" if uuid else job_id


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "zone",
        "connected",
        "idle_now",
        "running_now",
        "architectures",
        "last_seen_at",
        "revoked",
        "quarantine",
    ]
    list_filter = [ConnectionFilter, HealthFilter, "zone"]
    actions = ["release_selected"]
    search_fields = ["name"]
    exclude = ["token_hash"]
    filter_horizontal = ["projects"]
    fieldsets = [
        (None, {"fields": ["name", *EDITABLE]}),
        (
            "Capabilities, as last reported",
            {
                "fields": [
                    "architectures",
                    "system_features",
                    "max_concurrent_builds",
                    "max_concurrent_evals",
                    "can_eval",
                    "can_build",
                    "can_fetch",
                    "zone",
                    "endpoint",
                ]
            },
        ),
        ("Connection", {"fields": ["connected", "connected_at", "last_seen_at", "created_at"]}),
        ("Health", {"fields": ["quarantine", "blamed_in_row", "recent_seats"]}),
    ]
    # The worker reports its capabilities and the session owns the connection state;
    # the name is what member pins refer to.
    readonly_fields = [
        f for _, options in fieldsets for f in options["fields"] if f not in EDITABLE
    ]

    def get_queryset(self, request):
        # In the list's one query: the kinds of its live idle slots and the keys it runs now.
        fresh = idle_slot_fresh_since(timezone.now())
        slots = IdleSlot.objects.filter(worker=OuterRef("pk"), recorded_at__gte=fresh)
        running = DispatchedJob.objects.filter(worker=OuterRef("pk"), finished_at__isnull=True)
        return (
            super()
            .get_queryset(request)
            .annotate(
                idle_kinds=ArraySubquery(slots.order_by("kind").values("kind")),
                running_keys=ArraySubquery(
                    running.order_by("dispatched_at", "id").values("job_id")
                ),
            )
        )

    @admin.display(description="idle now")
    def idle_now(self, worker):
        kinds = ", ".join(worker.idle_kinds) or "-"
        return f"{kinds} (draining)" if worker.draining else kinds

    @admin.display(
        description="running now",
        ordering=Func(F("running_keys"), function="cardinality", output_field=IntegerField()),
    )
    def running_now(self, worker):
        """The open assignments' keys, shortened (the full keys on hover), the first few named."""
        keys = worker.running_keys
        if not keys:
            return "-"
        named = format_html_join(", ", "{}", ((short_key(k),) for k in keys[:KEYS_SHOWN]))
        more = f" and {len(keys) - KEYS_SHOWN} more" if len(keys) > KEYS_SHOWN else ""
        return format_html(
            '<span class="running-now" title="{}">{}{}</span>', " ".join(keys), named, more
        )

    @admin.display(description="quarantine")
    def quarantine(self, worker):
        """Reason, since and by whom, while quarantined; on probation after an automatic one."""
        now = timezone.now()
        q = health.quarantine_of(worker, now)
        if q is None:
            return "on probation" if health.on_probation(worker, now) else "-"
        since = date_format(timezone.localtime(q.since), "DATETIME_FORMAT")
        return format_html(
            '<span class="quarantine" data-by="{}">{} since {} by {}</span>',
            q.by,
            q.reason or "no reason given",
            since,
            q.by,
        )

    @admin.display(description="recent seats")
    def recent_seats(self, worker):
        """The latest cluster seats, newest first, with the blame of those that ended one."""
        rows = health.seat_rows(worker.pk)
        if not rows:
            return "-"
        body = format_html_join(
            "",
            '<tr class="seat" data-blamed="{}"><td>{}</td><td>cluster {}</td><td>{}</td>'
            "<td>{}</td><td>{}</td></tr>",
            (
                (
                    "yes" if r["blame"] else "no",
                    date_format(timezone.localtime(r["dispatched_at"]), "DATETIME_FORMAT"),
                    r["cluster"],
                    short_key(r["job_id"]),
                    r["outcome"] or "open",
                    f"blamed: {r['blame']}" if r["blame"] else "-",
                )
                for r in rows
            ),
        )
        return format_html(
            '<table id="recent-seats"><thead><tr><th>dispatched</th><th>cluster</th>'
            "<th>job</th><th>outcome</th><th>blame</th></tr></thead><tbody>{}</tbody></table>",
            body,
        )

    def has_release_permission(self, request):
        user = request.user
        return user.is_active and user.is_staff and user.has_perm("workers.change_worker")

    @admin.action(description="Release selected workers from quarantine", permissions=["release"])
    def release_selected(self, request, queryset):
        if not self.has_release_permission(request):
            raise PermissionDenied
        workers = list(queryset.order_by("name"))
        if request.POST.get("post") != "yes":  # the confirmation page first
            now = timezone.now()
            context = {
                **self.admin_site.each_context(request),
                "title": "Release workers from quarantine: are you sure?",
                "opts": self.opts,
                "media": self.media,
                "workers": [(w, health.quarantine_of(w, now)) for w in workers],
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/workers/worker/release_selected_confirmation.html", context
            )
        for worker in workers:
            health.release(worker)
        names = ", ".join(w.name for w in workers)
        self.message_user(request, f"Released {names} from quarantine.")
        return None  # back to the list

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        # Assignments reference their worker without ON DELETE: revoke instead.
        return False

    @admin.display(boolean=True)
    def connected(self, worker):
        return worker.connected

    @admin.display(boolean=True, ordering="revoked_at")
    def revoked(self, worker):
        return worker.revoked_at is not None

    def save_model(self, request, obj, form, change):
        # Write only what the form edits: a full save would put back the connection state
        # and last_seen_at as they were when the page was read, racing the live session.
        fields = [f for f in form.changed_data if f != "projects"]  # m2m: saved by save_related
        if fields:
            obj.save(update_fields=fields)
