"""Settings, all read from the environment (names and defaults in shared protocol.md)."""

from pathlib import Path

import environ
import redis.exceptions
from django.core.exceptions import ImproperlyConfigured

from gradient.secret_key import checkout_secret_key

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# Unset (development, the tests), each checkout makes its own key in run/ (gradient.secret_key).
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="")
if not SECRET_KEY:
    try:
        SECRET_KEY = checkout_secret_key(BASE_DIR / "run" / "secret_key")
    except OSError as e:
        raise ImproperlyConfigured(
            f"DJANGO_SECRET_KEY is unset and no key could be kept: {e}"
        ) from e
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

# Served over TLS (README, "Behind TLS"): HTTPS enforced, HSTS, cookies never in the clear.
BEHIND_TLS = env.bool("GRADIENT_BEHIND_TLS", default=False)
SECURE_SSL_REDIRECT = BEHIND_TLS
# WebSockets never pass the redirect's middleware. /metrics is exempt: a scraper often reads
# it from daphne's plain port, where https:// may not answer.
SECURE_REDIRECT_EXEMPT = [r"^metrics$"]
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = BEHIND_TLS
SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31_536_000 if BEHIND_TLS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool(
    "DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=BEHIND_TLS
)
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=BEHIND_TLS)
# The header a TLS-terminating proxy sets to "https" (e.g. X-Forwarded-Proto); it must set or
# strip it on every request, or a client could claim TLS it never used.
_PROXY_SSL_HEADER = env.str("DJANGO_SECURE_PROXY_SSL_HEADER", default="")
if _PROXY_SSL_HEADER:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "channels",
    "pgtrigger",
    "gradient.apps.GradientConfig",
    "gradient.jobs",
    "workers",
    "clusters",
    "sessions.apps.SessionsConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "gradient.urls"
ASGI_APPLICATION = "gradient.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db_url("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/gradient"),
}
# A connection idle inside a transaction must not block the claim's rivals for long. The
# triggers read pgtrigger.ignore on every row, and an unset one raises (caught, slowly). JIT
# costs the cluster book more than it saves on a deep queue (docs/design.md).
DATABASES["default"].setdefault("OPTIONS", {})
DATABASES["default"]["OPTIONS"].setdefault(
    "options",
    "-c idle_in_transaction_session_timeout={} -c pgtrigger.ignore={{}} -c jit=off".format(
        env.int("GRADIENT_IDLE_IN_TRANSACTION_TIMEOUT_MS", default=60_000)
    ),
)
# Server-side parameters, and statements prepared after their fifth run on a connection, so a
# frame's statements are not planned every time. GRADIENT_PREPARE_THRESHOLD=0 turns it off
# (behind a pooler in transaction mode).
DATABASES["default"]["OPTIONS"].setdefault("server_side_binding", True)
DATABASES["default"]["OPTIONS"].setdefault(
    "prepare_threshold", env.int("GRADIENT_PREPARE_THRESHOLD", default=5) or None
)
# Sessions and passes query constantly: reuse connections rather than open one per call.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DJANGO_CONN_MAX_AGE", default=300)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Django's backend, skipping a health check passed less than a second ago.
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["ENGINE"] = "gradient.postgresql"

# Threads per daphne process for the sessions' database work (sessions/threads.py).
FRAME_THREADS = env.int("GRADIENT_FRAME_THREADS", default=4)
REPORT_THREADS = env.int("GRADIENT_REPORT_THREADS", default=2)
ACCEPT_THREADS = env.int("GRADIENT_ACCEPT_THREADS", default=8)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# The admin's static files, served by WhiteNoise. Not hashed: a manifest storage would make
# every test that renders an admin page depend on a prior collectstatic.
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "run" / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

CHANNEL_CAPACITY = 10_000
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "gradient.channel_layer.BlockingRedisChannelLayer",
        "CONFIG": {
            # Per channel key, shared by every session of one daphne process: a burst of
            # AssignJobs must fit (docs/reliability.md).
            "capacity": CHANNEL_CAPACITY,
            "hosts": [
                {
                    "address": REDIS_URL,
                    "max_connections": env.int("GRADIENT_REDIS_MAX_CONNECTIONS", 200),
                    "timeout": env.float("GRADIENT_REDIS_POOL_TIMEOUT_SECS", 20),
                    # Longer than the layer's blocking pop, or a quiet channel fails its read.
                    "socket_timeout": 30,
                    # A session start waits on its group_add: a Redis gone must not hold it.
                    "socket_connect_timeout": 5,
                    # A Redis restart kills every pooled connection: retry once, on a new one.
                    "retry_on_error": [redis.exceptions.ConnectionError],
                }
            ],
        },
    },
}

CELERY_BROKER_URL = REDIS_URL
# kombu's Redis transport, minus the worker's exit on a lost broker (gradient/broker.py).
CELERY_BROKER_TRANSPORT = "gradient.broker:Transport"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup would close the connection around every task, so each pass would plan
# its statements afresh; gradient/celery.py drops broken or old connections instead.
CELERY_DB_REUSE_MAX = 1000

# The spec's durations (shared protocol.md, "Settings").
GRADIENT = {
    "CLUSTER_DISPATCH_INTERVAL_SECS": env.float("GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS", 5),
    "CLUSTER_PREPARE_TIMEOUT_SECS": env.float("GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS", 30),
    "CLUSTER_RETRY_BACKOFF_SECS": env.float("GRADIENT_CLUSTER_RETRY_BACKOFF_SECS", 30),
    "CLUSTER_RESERVE_AFTER_SECS": env.float("GRADIENT_CLUSTER_RESERVE_AFTER_SECS", 600),
    "CLUSTER_RESERVE_TIMEOUT_SECS": env.float("GRADIENT_CLUSTER_RESERVE_TIMEOUT_SECS", 1800),
    "IDLE_SLOT_TTL_SECS": env.float("GRADIENT_IDLE_SLOT_TTL_SECS", 25),
    "WORKER_TIMEOUT_SECS": env.float("GRADIENT_WORKER_TIMEOUT_SECS", 120),
    "RETENTION_DAYS": env.int("GRADIENT_RETENTION_DAYS", 30),
    # The head of the queue (protocol.md): jobs of a kind offered and chosen among, per part.
    "OFFER_WINDOW": env.int("GRADIENT_OFFER_WINDOW", 32),
    # How long the pass waits for an idle seat's scores of a cluster it has just offered.
    "SCORE_WAIT_MS": env.int("GRADIENT_SCORE_WAIT_MS", 1000),
    # Blamed seats in a row that quarantine a worker (0 disables), and for how long.
    "QUARANTINE_AFTER": env.int("GRADIENT_QUARANTINE_AFTER", 3),
    "QUARANTINE_SECS": env.float("GRADIENT_QUARANTINE_SECS", 3600),
    # Bounds how long a claim or close waits on a row lock before it gives up (and loses).
    "CLAIM_LOCK_TIMEOUT_MS": env.int("GRADIENT_CLAIM_LOCK_TIMEOUT_MS", 5_000),
    # Failed assignments after which a requeueing failure becomes permanent (per job).
    "MAX_JOB_ATTEMPTS": env.int("GRADIENT_MAX_JOB_ATTEMPTS", 3),
    # Frames a worker may send per second (sustained) and in a burst before Error rate_limited.
    "WORKER_RATE_PER_SEC": env.float("GRADIENT_WORKER_RATE_PER_SEC", 50),
    "WORKER_RATE_BURST": env.int("GRADIENT_WORKER_RATE_BURST", 200),
}

if GRADIENT["OFFER_WINDOW"] < 1:
    raise ImproperlyConfigured("GRADIENT_OFFER_WINDOW must be at least 1")
if GRADIENT["SCORE_WAIT_MS"] < 0:
    raise ImproperlyConfigured("GRADIENT_SCORE_WAIT_MS must not be negative")
if GRADIENT["QUARANTINE_AFTER"] < 0:
    raise ImproperlyConfigured("GRADIENT_QUARANTINE_AFTER must not be negative (0 disables)")
if GRADIENT["QUARANTINE_SECS"] <= 0:
    raise ImproperlyConfigured("GRADIENT_QUARANTINE_SECS must be positive")

# json: one object per line, with a record's cluster, attempt and worker ids (gradient/logs.py).
LOG_FORMAT = env.str("GRADIENT_LOG_FORMAT", default="plain")
if LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"GRADIENT_LOG_FORMAT must be plain or json, not {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "gradient.logs.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env.str("GRADIENT_LOG_LEVEL", default="INFO")},
}
# So that a Celery worker's passes log through the JSON formatter too.
CELERY_WORKER_HIJACK_ROOT_LOGGER = LOG_FORMAT != "json"

# When set, GET /metrics requires `Authorization: Bearer <token>`; unset, it is open.
METRICS_TOKEN = env.str("GRADIENT_METRICS_TOKEN", default="")

CELERY_BEAT_SCHEDULE = {
    "cluster-dispatch": {
        "task": "clusters.dispatch",
        "schedule": GRADIENT["CLUSTER_DISPATCH_INTERVAL_SECS"],
    },
    "cluster-recovery": {"task": "clusters.recover", "schedule": 30.0},
    "cluster-retention": {"task": "clusters.retention", "schedule": 3600.0},
    "worker-liveness": {"task": "sessions.liveness", "schedule": 10.0},
}
