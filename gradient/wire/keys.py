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


def member_key_sql(evaluation: str, derivation_build: str) -> str:
    """member_key as an SQL expression over a row's two job columns."""
    return (
        f"CASE WHEN {evaluation} IS NOT NULL THEN '{PREFIX['eval']}' || {evaluation}::text"
        f" ELSE '{PREFIX['build']}' || {derivation_build}::text END"
    )
