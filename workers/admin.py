"""Workers: `create_worker` creates them (showing the token once); the hash is never shown."""

from django.contrib import admin

from workers.models import Worker

EDITABLE = ["revoked_at", "all_projects", "projects"]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["name", "zone", "connected", "architectures", "last_seen_at", "revoked"]
    list_filter = ["zone"]
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
    ]
    # The worker reports its capabilities and the session owns the connection state;
    # the name is what member pins refer to.
    readonly_fields = [
        f for _, options in fieldsets for f in options["fields"] if f not in EDITABLE
    ]

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
