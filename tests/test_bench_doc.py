"""docs/benchmarks.md as the benchmark scripts write it: each section replaced alone, and the
summary table at the top, where each benchmark's run rewrites its own rows and no other's."""

from bench._common import (
    FAULT_ROW,
    SUMMARY,
    Figure,
    anchor,
    merge_rows,
    summary_rows,
    write_section,
)

CLAIM = "## Claim latency"
STORM = "## Connection storm"


def section(title: str, body: str) -> str:
    return f"{title}\n\n{body}\n"


def claim_figure(result: str, met: bool) -> Figure:
    return Figure("claim / floor, 8 members", "≤ 2x", result, met)


def storm_figures(seconds: str) -> list[Figure]:
    return [
        Figure("storm: every InitAck", "every worker", "1,000 of 1,000", True),
        Figure("restart: every worker back", "< 5 s", seconds, float(seconds) < 5),
    ]


def commands(doc) -> list[str]:
    return [row[-1] for row in summary_rows(doc.read_text())]


def headings(doc) -> list[str]:
    return [line for line in doc.read_text().splitlines() if line.startswith("## ")]


def test_a_new_file_opens_with_the_summary_holding_the_fault_suite_and_the_first_rows(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, CLAIM, section(CLAIM, "claim text"), "claim", [claim_figure("0.8x", True)])

    assert headings(doc) == [SUMMARY, CLAIM]
    rows = summary_rows(doc.read_text())
    assert rows[0] == FAULT_ROW
    assert rows[1] == [
        f"[claim / floor, 8 members]({anchor(CLAIM)})",
        "≤ 2x",
        "0.8x",
        "yes",
        "`bench/run claim`",
    ]


def test_replacing_one_benchmarks_rows_keeps_the_others_in_their_places(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, CLAIM, section(CLAIM, "claim 1"), "claim", [claim_figure("0.8x", True)])
    write_section(doc, STORM, section(STORM, "storm 1"), "storm", storm_figures("3.7"))
    storm_rows = summary_rows(doc.read_text())[2:]

    write_section(doc, CLAIM, section(CLAIM, "claim 2"), "claim", [claim_figure("2.5x", False)])

    rows = summary_rows(doc.read_text())
    assert commands(doc) == ["`bin/test tests/faults`", "`bench/run claim`"] + 2 * [
        "`bench/run storm`"
    ]
    assert rows[1][2:4] == ["2.5x", "**no**"]
    assert rows[2:] == storm_rows
    text = doc.read_text()
    assert "claim 2" in text and "claim 1" not in text and "storm 1" in text


def test_a_benchmark_writing_fewer_rows_than_before_leaves_none_of_its_old_ones(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, STORM, section(STORM, "storm"), "storm", storm_figures("3.7"))
    write_section(doc, CLAIM, section(CLAIM, "claim"), "claim", [claim_figure("0.8x", True)])

    write_section(doc, STORM, section(STORM, "storm"), "storm", storm_figures("6.1")[1:])

    rows = summary_rows(doc.read_text())
    assert [row[2] for row in rows] == [FAULT_ROW[2], "6.1", "0.8x"]


def test_a_new_section_is_appended_and_its_rows_after_the_others_with_the_table_on_top(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, CLAIM, section(CLAIM, "claim"), "claim", [claim_figure("0.8x", True)])

    write_section(doc, STORM, section(STORM, "storm"), "storm", storm_figures("3.7"))

    assert headings(doc) == [SUMMARY, CLAIM, STORM]
    assert commands(doc)[-2:] == ["`bench/run storm`", "`bench/run storm`"]
    assert doc.read_text().index(SUMMARY) < doc.read_text().index(CLAIM)


def test_a_file_without_a_summary_gets_it_before_its_first_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro.\n\n## Retention pass\n\nretention\n")

    write_section(doc, STORM, section(STORM, "storm"), "storm", storm_figures("3.7"))

    assert headings(doc) == [SUMMARY, "## Retention pass", STORM]
    assert doc.read_text().startswith("# Benchmarks\n\nIntro.\n\n## Summary\n")


def test_a_section_without_targets_leaves_the_summary_as_it_was(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, CLAIM, section(CLAIM, "claim"), "claim", [claim_figure("0.8x", True)])
    before = summary_rows(doc.read_text())

    write_section(doc, "## Retention pass", section("## Retention pass", "retention"))

    assert summary_rows(doc.read_text()) == before
    assert headings(doc) == [SUMMARY, CLAIM, "## Retention pass"]


def test_rows_not_measured_yet_are_replaced_by_the_first_run_where_they_stood():
    command = "`bench/run queue-depth`"
    waiting = [["deep queue: builds/s", "≥ 150", "not measured", "not measured", command]]
    new = [["[deep queue: builds/s](#deep-queue)", "≥ 150", "151.0", "yes", command]]

    assert merge_rows([*waiting, FAULT_ROW], "queue-depth", new) == [*new, FAULT_ROW]


def test_the_anchor_is_the_headings_link_target():
    assert anchor("## Gang-start latency") == "#gang-start-latency"
    assert anchor("## Dispatch pass (1,000 x 5,000)") == "#dispatch-pass-1000-x-5000"
