"""A run's environment (protocol.md, "A run"): the agent's own less its GRADIENT_ names, the
job's env, and the variables that tell a process who it is and who its peers are."""

import json

from workers.agent.env import Member, hostfile_text, job_env, peer_variable

ROSTER = [
    {"role": "db", "index": 0, "worker": "w1", "zone": "z", "endpoint": "10.0.0.1:5432"},
    {"role": "web-front", "index": 1, "worker": "w2", "zone": None, "endpoint": None},
]
IDS = {"job_id": "build:j", "assignment_id": "a-1", "worker": "w1"}


def member(**overrides) -> Member:
    fields = {
        "attempt": "att",
        "role": "db",
        "index": 0,
        "roster": ROSTER,
        "roster_file": "/run/roster.json",
        "hostfile": "/run/hostfile",
        "signal_socket": "/run/s.sock",
    }
    return Member(**(fields | overrides))


def test_a_single_job_gets_the_agents_env_its_own_and_who_it_is():
    agent = {"PATH": "/bin", "HOME": "/h", "SHARED": "agent"}
    env = job_env(agent, {"SHARED": "job", "EXTRA": "1"}, endpoint="h:1", **IDS)
    assert env == {
        "PATH": "/bin",
        "HOME": "/h",
        "SHARED": "job",
        "EXTRA": "1",
        "GRADIENT_JOB_ID": "build:j",
        "GRADIENT_ASSIGNMENT_ID": "a-1",
        "GRADIENT_WORKER": "w1",
        "GRADIENT_ENDPOINT": "h:1",
    }


def test_the_agents_token_and_other_gradient_names_never_reach_a_job():
    agent = {"PATH": "/bin", "GRADIENT_WORKER_TOKEN": "secret", "GRADIENT_ROLE": "stale"}
    env = job_env(agent, {}, endpoint=None, **IDS)
    assert "GRADIENT_WORKER_TOKEN" not in env and "GRADIENT_ROLE" not in env
    assert env["GRADIENT_ENDPOINT"] == ""


def test_a_member_is_told_its_place_its_roster_its_files_and_its_socket():
    env = job_env({}, {}, endpoint="10.0.0.1:5432", member=member(), **IDS)
    assert env["GRADIENT_ATTEMPT"] == "att"
    assert (env["GRADIENT_ROLE"], env["GRADIENT_INDEX"]) == ("db", "0")
    assert json.loads(env["GRADIENT_ROSTER"]) == ROSTER
    assert env["GRADIENT_ROSTER_FILE"] == "/run/roster.json"
    assert env["GRADIENT_HOSTFILE"] == "/run/hostfile"
    assert env["GRADIENT_SIGNAL_SOCKET"] == "/run/s.sock"


def test_each_peer_is_named_by_role_and_index_with_its_endpoint_or_empty():
    env = job_env({}, {}, endpoint=None, member=member(), **IDS)
    peers = {name: value for name, value in env.items() if name.startswith("GRADIENT_PEER_")}
    assert peers == {"GRADIENT_PEER_DB_0": "10.0.0.1:5432", "GRADIENT_PEER_WEB_FRONT_1": ""}


def test_a_role_becomes_a_name_a_shell_can_read():
    assert peer_variable("db", 0) == "GRADIENT_PEER_DB_0"
    assert peer_variable("web.front-2", 3) == "GRADIENT_PEER_WEB_FRONT_2_3"
    assert peer_variable("ünï cödé", 1) == "GRADIENT_PEER__N__C_D__1"


def test_the_hostfile_lists_each_members_endpoint_or_its_workers_name_in_roster_order():
    assert hostfile_text(ROSTER) == "10.0.0.1:5432\nw2\n"
    assert hostfile_text(ROSTER[::-1]) == "w2\n10.0.0.1:5432\n"


def test_the_gradient_variables_win_over_a_jobs_env():
    env = job_env({}, {"GRADIENT_JOB_ID": "forged"}, endpoint=None, **IDS)
    assert env["GRADIENT_JOB_ID"] == "build:j"
