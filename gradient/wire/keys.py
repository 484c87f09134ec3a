"""The job key: a job's name on the wire (AssignJob.job_id, every report) and in
dispatched_job.job_id and job_score: its kind, a colon, its id ("eval:<uuid>"). Built and
matched here alone, in Python and in SQL."""

KINDS = ("eval", "build")  # JobKind's values
PREFIX = {kind: f"{kind}:" for kind in KINDS}
UUID_PATTERN = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
JOB_KEY_PATTERN = rf"^({'|'.join(KINDS)}):{UUID_PATTERN}$"


def job_key(kind: str, job_uuid) -> str:
    return f"{PREFIX[kind]}{job_uuid}"


def member_key(evaluation_id, derivation_build_id) -> str:
    """The key of a cluster member's job: exactly one of the two is set."""
    if evaluation_id:
        return job_key("eval", evaluation_id)
    return job_key("build", derivation_build_id)


def job_key_sql(kind: str, job_id: str) -> str:
    """job_key as an SQL expression: the key of the job of `kind` whose id is the SQL `job_id`."""
    return f"'{PREFIX[kind]}' || {job_id}::text"


def member_key_sql(evaluation: str, derivation_build: str) -> str:
    """member_key as an SQL expression over a row's two job columns."""
    return (
        f"CASE WHEN {evaluation} IS NOT NULL THEN {job_key_sql('eval', evaluation)}"
        f" ELSE {job_key_sql('build', derivation_build)} END"
    )


def key_kind_sql(key: str) -> str:
    """The kind of a job key, as an SQL expression over the SQL `key`."""
    return f"split_part({key}, ':', 1)"
