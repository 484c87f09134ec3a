# The web image; compose.yaml runs the Celery worker and beat from it too.
# uv is pinned, so every build installs from uv.lock with the same tool.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1

RUN pip install --no-cache-dir uv==0.13.9 \
    && useradd --system --create-home --uid 10001 gradient

WORKDIR /app

# Dependencies first, from the lock only, so code changes reuse this layer.
COPY pyproject.toml uv.lock .python-version ./
RUN uv sync --frozen --no-dev --no-cache --python /usr/local/bin/python3

COPY . .
RUN DJANGO_SECRET_KEY=collectstatic-only .venv/bin/python manage.py collectstatic --noinput \
    && mkdir -p run/logs && chown -R gradient:gradient run

ENV PATH="/app/.venv/bin:$PATH"
USER gradient
EXPOSE 8000
CMD ["python", "-m", "gradient.serve", "-b", "0.0.0.0", "-p", "8000"]
