from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from gradient.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
]
