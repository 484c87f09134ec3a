"""Scores from the machine (protocol.md, "The agent"): present paths from the store's
entries, what absent ones weigh from the NarSize of a binary cache's narinfo files."""

import pytest

from workers.agent.scores import missing_cost, store_name

A, B, C = "/nix/store/aaa-hello", "/nix/store/bbb-glibc", "/nix/store/ccc-gcc"


@pytest.fixture
def store(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "aaa-hello").mkdir()
    return store


@pytest.fixture
def cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "bbb.narinfo").write_text(
        "StorePath: /nix/store/bbb-glibc\nURL: nar/x.nar.xz\nNarSize: 1234\nReferences: \n"
    )
    return cache


def test_a_path_is_present_when_its_store_entry_exists(store):
    assert missing_cost([A], store, None) == (0, 0)
    assert missing_cost([A, B, C], store, None) == (2, 0)


def test_an_absent_path_weighs_its_narinfos_nar_size_and_nothing_without_one(store, cache):
    assert missing_cost([A, B], store, cache) == (1, 1234)
    assert missing_cost([B, C], store, cache) == (2, 1234)


def test_a_store_entry_that_is_a_file_or_a_link_counts_as_present(store):
    (store / "bbb-glibc").write_text("")
    (store / "ccc-gcc").symlink_to(store / "aaa-hello")
    assert missing_cost([B, C], store, None) == (0, 0)


def test_a_narinfo_without_a_readable_nar_size_weighs_nothing(store, cache):
    (cache / "ccc.narinfo").write_text("StorePath: /nix/store/ccc-gcc\nNarSize: lots\n")
    assert missing_cost([C], store, cache) == (1, 0)


def test_a_path_that_names_no_store_entry_is_absent_and_weighs_nothing(store, cache):
    assert store_name("/nix/store/") is None and store_name("/nix/store/..") is None
    assert missing_cost(["/nix/store/", "/nix/store/.."], store, cache) == (2, 0)
    assert store_name("/nix/store/aaa-hello/bin/hello") == "aaa-hello"
    assert missing_cost(["/nix/store/aaa-hello/bin/hello"], store, cache) == (0, 0)
