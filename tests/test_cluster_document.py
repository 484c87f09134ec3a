"""submit_cluster --file: the whole cluster as one JSON document, from a file or standard
input; a document that breaks a rule is refused in one line naming the field, writing nothing."""

import json

import pytest
from django.utils import timezone

from clusters.models import ClusterJob
from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, EvaluationStatus
from tests.commands import manage, run
from tests.factories import ProjectFactory, WorkerFactory
from tests.test_commands_refusals import refusal, table_contents

pytestmark = pytest.mark.django_db

FULL = {
    "project": "web",
    "same_zone": True,
    "retry_budget": 2,
    "prioritized": True,
    "members": [
        {
            "role": "server",
            "kind": "eval",
            "primary": True,
            "pin": "w1",
            "arch": "aarch64-linux",
            "features": ["kvm", "big"],
            "paths": ["/nix/store/abc-server"],
            "command": ["python", "-m", "server", "--port=8080"],
            "env": {"PORT": "8080", "LOG": "debug"},
            "timeout_secs": 600,
        },
        {"role": "client", "kind": "build"},
        {"role": "client", "kind": "build", "command": ["client", "$GRADIENT_PEER_SERVER_0"]},
    ],
}


@pytest.fixture
def world():
    ProjectFactory(name="web")
    WorkerFactory(name="w1")
    WorkerFactory(name="gone", revoked_at=timezone.now())


def submitted(tmp_path, document) -> dict:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(document))
    return run("submit_cluster", "--file", str(path))


def refused(tmp_path, document, *more) -> str:
    """The one-line refusal of a document (or of raw text), and that nothing was written."""
    path = tmp_path / "cluster.json"
    path.write_bytes(document if isinstance(document, bytes) else json.dumps(document).encode())
    before = table_contents()
    message = refusal("submit_cluster", "--file", str(path), *more)
    assert table_contents() == before
    return message


def member(**fields):
    return {"role": "a", "kind": "eval"} | fields


def with_members(*members, **fields):
    return {"project": "web", "members": list(members)} | fields


@pytest.mark.usefixtures("world")
def test_a_full_document_makes_the_cluster_it_describes(tmp_path):
    out = submitted(tmp_path, FULL)

    cluster = ClusterJob.objects.get(pk=out["cluster"])
    assert (cluster.same_zone, cluster.retry_budget, cluster.prioritized) == (True, 2, True)
    assert [m["role"] for m in out["members"]] == ["server", "client", "client"]
    server = cluster.members.get(role="server")
    assert (server.primary, server.pin) == (True, "w1")
    evaluation = Evaluation.objects.get()
    assert (evaluation.job_key, evaluation.status) == (out["members"][0]["job_id"], "Queued")
    assert (
        evaluation.architecture,
        evaluation.required_features,
        evaluation.paths,
        evaluation.prioritized,
    ) == ("aarch64-linux", ["kvm", "big"], ["/nix/store/abc-server"], True)
    assert (evaluation.command, evaluation.env, evaluation.timeout_secs) == (
        ["python", "-m", "server", "--port=8080"],
        {"PORT": "8080", "LOG": "debug"},
        600,
    )
    builds = {b.job_key: b for b in DerivationBuild.objects.all()}
    plain, runs = (builds[m["job_id"]] for m in out["members"][1:])
    assert (plain.command, plain.env, plain.timeout_secs, plain.architecture) == (
        None,
        {},
        None,
        "x86_64-linux",
    )
    assert plain.status == BuildStatus.QUEUED and plain.prioritized
    assert runs.command == ["client", "$GRADIENT_PEER_SERVER_0"]
    # As show_cluster reads it back, with each role's index.
    shown = run("show_cluster", str(cluster.pk))
    assert [(m["role"], m["primary"], m["pin"]) for m in shown["members"]] == [
        ("client", False, None),
        ("client", False, None),
        ("server", True, "w1"),
    ]


@pytest.mark.usefixtures("world")
def test_only_the_project_members_roles_and_kinds_are_required(tmp_path):
    out = submitted(tmp_path, with_members(member()))
    cluster = ClusterJob.objects.get(pk=out["cluster"])
    assert (cluster.same_zone, cluster.retry_budget, cluster.prioritized) == (False, 0, False)
    job = Evaluation.objects.get()
    assert (job.status, job.architecture, job.command, job.env) == (
        EvaluationStatus.QUEUED,
        "x86_64-linux",
        None,
        {},
    )
    assert cluster.members.get().pin is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("world")
def test_a_document_read_from_standard_input_in_a_real_process():
    done = manage("submit_cluster", "--file", "-", input=json.dumps(FULL))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert ClusterJob.objects.get(pk=out["cluster"]).members.count() == 3
    assert Evaluation.objects.get().command == ["python", "-m", "server", "--port=8080"]

    bad = manage("submit_cluster", "--file", "-", input='{"project": "web", "members": []}')
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0
    assert "members: List should have at least 1 item" in bad.stderr
    assert ClusterJob.objects.count() == 1


DOCUMENT_REFUSALS = {
    "no project": ({"members": [member()]}, "project: is required"),
    "no members": ({"project": "web"}, "members: is required"),
    "empty members": (with_members(), "members: List should have at least 1 item"),
    "a member without a role": (with_members({"kind": "eval"}), "members[0].role: is required"),
    "a member without a kind": (
        with_members(member(), {"role": "b"}),
        "members[1].kind: is required",
    ),
    "an unknown field": (with_members(member(comand=["x"])), "members[0].comand: unknown field"),
    "an unknown top-level field": (with_members(member(), zone="a"), "zone: unknown field"),
    "a project that is no string": ({"project": 1, "members": [member()]}, "project: Input"),
    "an unknown project": ({"project": "nope", "members": [member()]}, "project: unknown project"),
    "a same_zone that is no boolean": (with_members(member(), same_zone="yes"), "same_zone:"),
    "a retry budget as a string": (with_members(member(), retry_budget="2"), "retry_budget:"),
    "a negative retry budget": (
        with_members(member(), retry_budget=-1),
        "retry_budget: retry budget must not be negative",
    ),
    "a retry budget beyond its column": (
        with_members(member(), retry_budget=2**31),
        "retry_budget: retry budget must be at most 2147483647",
    ),
    "members that is no list": ({"project": "web", "members": {}}, "members: Input should be"),
    "a member that is no object": (with_members(member(), "b:eval"), "members[1]: Input should"),
    "an unknown kind": (with_members(member(), member(kind="vm")), "members[1].kind: unknown kind"),
    "an empty role": (with_members(member(role=" ")), "members[0].role: empty role"),
    "an over-long role": (with_members(member(role="r" * 101)), "members[0].role: role is longer"),
    "a NUL in a role": (with_members(member(role="a\x00")), "members[0].role: contains a NUL"),
    "a primary that is no boolean": (with_members(member(primary=1)), "members[0].primary:"),
    "two primaries": (
        with_members(member(primary=True), member(role="b", primary=True)),
        "members: more than one primary member",
    ),
    "an over-long architecture": (
        with_members(member(arch="x" * 65)),
        "members[0].arch: architecture must be 1 to 64",
    ),
    "features that are no list": (with_members(member(features="kvm")), "members[0].features:"),
    "a feature that is no string": (
        with_members(member(features=["kvm", 1])),
        "members[0].features[1]:",
    ),
    "an empty feature": (
        with_members(member(features=["kvm", ""])),
        "members[0].features: item 1 is empty",
    ),
    "an empty path": (with_members(member(paths=[""])), "members[0].paths: item 0 is empty"),
    "a pin naming an unknown worker": (
        with_members(member(pin="w1"), member(role="b", pin="ghost")),
        "members[1].pin: pin names unknown worker(s): 'ghost'",
    ),
    "a pin naming a revoked worker": (
        with_members(member(role="b"), member(pin="gone")),
        "members[1].pin: pin names revoked worker(s): 'gone'",
    ),
    "one worker pinned twice": (
        with_members(member(pin="w1"), member(role="b", pin="w1")),
        "members[0].pin: members sit on distinct workers; pinned twice: 'w1'",
    ),
    "a command that is a string": (
        with_members(member(), member(role="b", command="make check")),
        "members[1].command: must be a JSON array of 1 to 64 strings",
    ),
    "an empty argument": (
        with_members(member(command=["make", ""])),
        "members[0].command: argument 1 is empty",
    ),
    "a NUL in an argument": (
        with_members(member(command=["a\x00"])),
        "members[0].command: argument 0 contains a NUL byte",
    ),
    "an env that is no object": (
        with_members(member(env=["A=1"])),
        "members[0].env: must be a JSON object",
    ),
    "a null env": (with_members(member(env=None)), "members[0].env: must be a JSON object"),
    "a reserved env name": (
        with_members(member(env={"GRADIENT_ROSTER": "[]"})),
        "members[0].env: name 'GRADIENT_ROSTER' starts with GRADIENT_",
    ),
    "a timeout of zero": (
        with_members(member(timeout_secs=0)),
        "members[0].timeout_secs: must be an integer from 1 to 604800",
    ),
    "a timeout as a string": (
        with_members(member(timeout_secs="60")),
        "members[0].timeout_secs: must be an integer",
    ),
    "a key given twice": (
        b'{"project": "web", "members": [{"role": "a", "kind": "eval", "kind": "build"}]}',
        "kind: given twice in one object",
    ),
    "a document that is no JSON": (b"project: web", "document: not JSON"),
    "a document that is no object": (b"[]", "document: Input should be"),
    "a document that is no UTF-8": (b'{"project": "w\xffb"}', "document: not UTF-8 text"),
}


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(("document", "error"), DOCUMENT_REFUSALS.values(), ids=DOCUMENT_REFUSALS)
def test_a_document_that_breaks_a_rule_is_refused_naming_the_field(tmp_path, document, error):
    assert refused(tmp_path, document).startswith(error)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    "option",
    [
        "--project=web",
        "--member=a:eval",
        "--same-zone",
        "--prioritized",
        "--retry-budget=0",  # the default, still an option beside the document
    ],
)
def test_every_other_option_beside_file_is_refused(tmp_path, option):
    message = refused(tmp_path, FULL, option)
    assert message.startswith("--file takes the whole cluster;")
    assert option.split("=")[0] in message


@pytest.mark.usefixtures("world")
def test_a_file_that_cannot_be_read_is_refused_in_one_line(tmp_path):
    before = table_contents()
    message = refusal("submit_cluster", "--file", str(tmp_path / "missing.json"))
    assert message.startswith("--file: cannot read") and "No such file" in message
    assert table_contents() == before


@pytest.mark.usefixtures("world")
def test_the_member_options_still_make_a_cluster_without_a_file():
    out = run("submit_cluster", "--project=web", "--member=a:eval", "--retry-budget=1")
    assert ClusterJob.objects.get(pk=out["cluster"]).retry_budget == 1
