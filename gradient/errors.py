class NotAllowed(Exception):
    """A well-formed request that is not allowed now (a report for a job the worker does not
    hold, a signal from a non-member, ...). Nothing was changed; the session answers it with
    Error not_allowed."""
