"""The project package. Importing it imports nothing else: the worker agent uses gradient.wire
on machines without Django's settings. The Celery app is loaded by gradient.apps once Django
is set up, and `celery -A gradient` finds it in gradient.celery."""
