"""The work a job carries (gradient.jobs.work): every way in refuses what breaks a rule with one
line naming the field, and writes nothing; what passes is stored as given."""

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from gradient.jobs.models import DerivationBuild, Evaluation
from gradient.jobs.submission import JobSpec, SubmissionError
from gradient.jobs.work import WorkError, check_work, kept_error, kept_log_tail
from gradient.wire.protocol import MAX_LOG_TAIL_BYTES
from tests.commands import run
from tests.factories import BuildFactory, EvaluationFactory, ProjectFactory
from tests.test_commands_refusals import refusal, table_contents

GOOD = {"command": ["pytest", "-x", "tests"], "env": {"PGHOST": "db", "_x1": ""}}

# (field, value, what the refusal says): each breaks one rule.
BAD_WORK = [
    ("command", [], "1 to 64 strings"),
    ("command", "pytest -x", "1 to 64 strings"),
    ("command", {"argv": ["a"]}, "1 to 64 strings"),
    ("command", ["a"] * 65, "1 to 64 strings"),
    ("command", ["ok", ""], "argument 1 is empty"),
    ("command", ["ok", 3], "argument 1 is not a string"),
    ("command", ["ok", None], "argument 1 is not a string"),
    ("command", ["a\x00b"], "argument 0 contains a NUL byte"),
    ("command", ["a\udcc3"], "argument 0 is not valid UTF-8"),
    ("command", ["x" * 65_000, "y" * 600], "over 65536 bytes"),
    ("command", ["é" * 33_000], "over 65536 bytes"),  # two bytes each: counted in bytes
    ("env", None, "JSON object"),
    ("env", ["A=1"], "JSON object"),
    ("env", {"A-B": "1"}, "name 'A-B' is not"),
    ("env", {"1A": "1"}, "name '1A' is not"),
    ("env", {"": "1"}, "name '' is not"),
    ("env", {"GRADIENT_ROLE": "x"}, "starts with GRADIENT_"),
    ("env", {"A": 1}, "the value of A is not a string"),
    ("env", {"A": "a\x00"}, "the value of A contains a NUL byte"),
    ("env", {"A": "x" * (16 * 1024)}, "over 16384 bytes"),
    ("timeout_secs", 0, "1 to 604800"),
    ("timeout_secs", -5, "1 to 604800"),
    ("timeout_secs", 604801, "1 to 604800"),
    ("timeout_secs", 2**63, "1 to 604800"),
    ("timeout_secs", True, "1 to 604800"),
    ("timeout_secs", 1.5, "1 to 604800"),
    ("timeout_secs", "60", "1 to 604800"),
]
WORK_IDS = [f"{field}={str(value)[:20]}" for field, value, _ in BAD_WORK]
# A model's integer field makes an int of what it is given (True, "60") before its clean(),
# and refuses one beyond its column itself: the timeouts a form could bring are integers.
MODEL_WORK = [
    case
    for case in BAD_WORK
    if case[0] != "timeout_secs" or (type(case[1]) is int and abs(case[1]) < 2**31)
]


def work(**changed):
    return {"command": None, "env": {}, "timeout_secs": None} | changed


def test_the_bounds_themselves_pass():
    check_work(["a"] * 64, {"A" * 10: "v"}, 1)
    check_work(None, {}, 604800)
    check_work(["x" * (65536 - 4)], {}, None)  # ["…"]: the brackets and quotes count
    check_work(None, {"A": "x" * (16384 - 8)}, None)  # {"A":"…"}
    with pytest.raises(WorkError):
        check_work(["x" * (65536 - 3)], {}, None)


@pytest.mark.parametrize(("field", "value", "problem"), BAD_WORK, ids=WORK_IDS)
def test_each_rule_refuses_naming_the_field(field, value, problem):
    with pytest.raises(WorkError) as refused:
        check_work(**work(**{field: value}))
    assert refused.value.field == field
    assert problem in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("field", "value", "problem"), BAD_WORK, ids=WORK_IDS)
def test_a_job_spec_refuses_the_same_naming_the_field(field, value, problem):
    with pytest.raises(SubmissionError) as refused:
        JobSpec(kind="build", **{field: value})
    assert refused.value.field == field
    assert refused.value.line().startswith(f"{field}: ") and problem in refused.value.line()


@pytest.mark.django_db
@pytest.mark.parametrize("factory", [EvaluationFactory, BuildFactory])
@pytest.mark.parametrize(("field", "value", "problem"), MODEL_WORK)
def test_the_models_validation_refuses_the_same_for_a_form(factory, field, value, problem):
    job = factory.build(project=ProjectFactory(), **work(**{field: value}))
    with pytest.raises(ValidationError) as refused:
        job.full_clean()
    assert list(refused.value.message_dict) == [field]
    assert problem in refused.value.message_dict[field][0]


@pytest.mark.django_db
def test_a_job_with_work_is_stored_as_given_and_one_without_has_none():
    project = ProjectFactory()
    job = EvaluationFactory(project=project, timeout_secs=3600, **GOOD)
    job.full_clean()
    job.refresh_from_db()
    assert (job.command, job.env, job.timeout_secs) == (GOOD["command"], GOOD["env"], 3600)
    bare = BuildFactory(project=project)
    bare.full_clean()
    bare.refresh_from_db()
    assert (bare.command, bare.env, bare.timeout_secs) == (None, {}, None)


@pytest.mark.django_db
@pytest.mark.parametrize("table", ["evaluation", "derivation_build"])
@pytest.mark.parametrize("timeout", [0, 604801])
def test_postgresql_holds_the_timeouts_range_too(raw_sql, table, timeout):
    job = (EvaluationFactory if table == "evaluation" else BuildFactory)()
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        raw_sql(f"UPDATE {table} SET timeout_secs = %s WHERE id = %s", [timeout, job.pk])
    assert refused.value.__cause__.diag.constraint_name == f"{table}-timeout_secs"


@pytest.mark.django_db
def test_a_job_row_written_without_work_gets_the_defaults(raw_sql):
    project = ProjectFactory()
    raw_sql(
        "INSERT INTO evaluation (id, project_id, architecture, required_features, paths,"
        " prioritized, created_at, updated_at, status)"
        " VALUES (gen_random_uuid(), %s, 'x86_64-linux', '{}', '{}', false, now(), now(),"
        " 'Queued')",
        [project.pk],
    )
    assert Evaluation.objects.values_list("command", "env", "timeout_secs").get() == (
        None,
        {},
        None,
    )


# submit_job's flags


@pytest.mark.django_db
def test_submit_job_queues_jobs_carrying_the_work_given():
    ProjectFactory(name="web")
    out = run(
        "submit_job",
        "--project=web",
        "--kind=build",
        "--count=2",
        '--command=["make", "check", "--jobs=4"]',
        "--env=PGHOST=db",
        "--env=OPTS=a=b c",
        "--env=EMPTY=",
        "--timeout-secs=900",
    )
    assert len(out["job_ids"]) == 2
    assert (
        list(DerivationBuild.objects.values_list("command", "env", "timeout_secs"))
        == [(["make", "check", "--jobs=4"], {"PGHOST": "db", "OPTS": "a=b c", "EMPTY": ""}, 900)]
        * 2
    )


@pytest.mark.django_db
def test_submit_job_without_work_queues_jobs_without_it():
    ProjectFactory(name="web")
    run("submit_job", "--project=web", "--kind=eval")
    assert Evaluation.objects.values_list("command", "env", "timeout_secs").get() == (
        None,
        {},
        None,
    )


JOB = ["submit_job", "--project=web", "--kind=eval"]
SUBMIT_JOB_REFUSALS = {
    "a command that is not JSON": ([*JOB, "--command=make check"], "--command: not JSON"),
    "a command that is a string": ([*JOB, '--command="make"'], "--command: must be a JSON array"),
    "an empty command": ([*JOB, "--command=[]"], "--command: must be a JSON array of 1 to 64"),
    "an empty argument": ([*JOB, '--command=["make", ""]'], "--command: argument 1 is empty"),
    "a NUL escaped in the JSON": ([*JOB, '--command=["a\\u0000"]'], "--command: argument 0"),
    "a command given twice": ([*JOB, '--command=["a"]', '--command=["b"]'], "more than once"),
    "an env without =": ([*JOB, "--env=PGHOST"], "--env: 'PGHOST' is not NAME=VALUE"),
    "an env name given twice": ([*JOB, "--env=A=1", "--env=A=2"], "--env: A given more than"),
    "a bad env name": ([*JOB, "--env=A-B=1"], "--env: name 'A-B' is not"),
    "a reserved env name": ([*JOB, "--env=GRADIENT_WORKER=x"], "--env: name 'GRADIENT_WORKER'"),
    "a zero timeout": ([*JOB, "--timeout-secs=0"], "--timeout-secs: must be an integer from 1"),
    "a timeout over a week": ([*JOB, "--timeout-secs=604801"], "--timeout-secs: must be"),
    "a timeout that is no number": ([*JOB, "--timeout-secs=soon"], "invalid int value"),
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "error"), SUBMIT_JOB_REFUSALS.values(), ids=SUBMIT_JOB_REFUSALS.keys()
)
def test_submit_job_refuses_bad_work_in_one_line_writing_nothing(args, error):
    ProjectFactory(name="web")
    before = table_contents()
    assert error in refusal(*args)
    assert table_contents() == before


# What a report's output leaves with the assignment.


def test_a_log_tail_within_the_limit_is_kept_whole():
    text = "é" * (MAX_LOG_TAIL_BYTES // 2)  # exactly the limit in bytes
    assert kept_log_tail(text) == text
    assert kept_log_tail(None) is None
    assert kept_log_tail("") == ""


def test_a_longer_log_tail_is_cut_at_its_start_on_a_character_boundary():
    # One byte over the limit, with the cut falling inside a two-byte character: the part of
    # it left over goes, and the end of the output stays.
    text = "start" + "é" * (MAX_LOG_TAIL_BYTES // 2) + "end"
    kept = kept_log_tail(text)
    assert text.endswith(kept) and kept.endswith("end")
    assert len(kept.encode()) == MAX_LOG_TAIL_BYTES - 1
    assert kept.startswith("é")
    # Three- and four-byte characters likewise.
    for char in ("€", "😀"):
        kept = kept_log_tail("x" + char * MAX_LOG_TAIL_BYTES)
        assert set(kept) == {char} and len(kept.encode()) <= MAX_LOG_TAIL_BYTES
        assert len(kept.encode()) > MAX_LOG_TAIL_BYTES - len(char.encode())


def test_an_error_is_kept_from_its_start_without_nuls():
    assert kept_error("exit status 1") == "exit status 1"
    assert kept_error(None) is None
    assert kept_error("a\x00b") == "a\ufffdb"
    assert kept_error("e" * 10_000) == "e" * 4096
