class NotAllowed(Exception):
    """A well-formed request that is not allowed now (a report for a job the worker does not hold,
    ...). Nothing was changed; the session answers Error not_allowed."""
