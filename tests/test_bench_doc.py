"""docs/benchmarks.md as the benchmark scripts write it: each benchmark's figures block replaced
alone, the prose around it kept, and the summary table at the top, where each benchmark's run
rewrites its own rows and no other's. And the one percentile every benchmark takes."""

import statistics

import pytest

from bench._common import MARK, SUMMARY, Figure, percentile, summary_row, write

CLAIM = "## Claim latency"
STORM = "## Connection storm"
DOC = f"""# Benchmarks

Intro.

## Summary

{SUMMARY}
| figure | target | result | met | command |
|:---|:---|:---|:---|:---|
| fault suite | 0 | 0 | yes | `bin/test tests/faults` |
<!-- /figures -->

{CLAIM}

{MARK.format("claim")}
| old claim |
<!-- /figures -->

How the claim is measured, by hand.
"""


def claim_figure(result: str, met: bool) -> Figure:
    return Figure("claim / floor, 8 members", "≤ 2x", result, met)


def storm_figures(seconds: str) -> list[Figure]:
    return [
        Figure("storm: every InitAck", "every worker", "1,000 of 1,000", True),
        Figure("restart: every worker back", "< 5 s", seconds, float(seconds) < 5),
    ]


def summary(doc) -> list[list[str]]:
    text = doc.read_text()
    table = text[text.index(SUMMARY) : text.index("<!-- /figures -->")].splitlines()[3:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(DOC)
    return path


def test_a_run_replaces_its_figures_block_and_keeps_the_prose_around_it(doc):
    write(doc, "claim", CLAIM, "| new claim |", [claim_figure("0.8x", True)])

    text = doc.read_text()
    assert "| new claim |" in text and "| old claim |" not in text
    assert text.startswith("# Benchmarks\n\nIntro.\n")
    assert text.endswith("How the claim is measured, by hand.\n")


def test_replacing_one_benchmarks_rows_keeps_the_others_in_their_places(doc):
    write(doc, "claim", CLAIM, "claim 1", [claim_figure("0.8x", True)])
    write(doc, "storm", STORM, "storm 1", storm_figures("3.7"))
    storm_rows = summary(doc)[2:]

    write(doc, "claim", CLAIM, "claim 2", [claim_figure("2.5x", False)])

    rows = summary(doc)
    assert [row[-1] for row in rows] == ["`bin/test tests/faults`", "`bench/run claim`"] + 2 * [
        "`bench/run storm`"
    ]
    assert rows[1][2:4] == ["2.5x", "**no**"]
    assert rows[2:] == storm_rows
    assert "storm 1" in doc.read_text()


def test_a_benchmark_writing_fewer_rows_than_before_leaves_none_of_its_old_ones(doc):
    write(doc, "storm", STORM, "storm", storm_figures("3.7"))

    write(doc, "storm", STORM, "storm", storm_figures("6.1")[1:])

    assert [row[2] for row in summary(doc)] == ["0", "6.1"]


def test_a_new_benchmark_gets_a_section_at_the_end_and_its_rows_last(doc):
    write(doc, "storm", STORM, "storm figures", storm_figures("3.7"))

    text = doc.read_text()
    assert text.index(CLAIM) < text.index(STORM) < text.index("storm figures")
    assert summary(doc)[-1] == summary_row("storm", STORM, storm_figures("3.7")[1])


def test_a_benchmark_without_targets_leaves_the_summary_as_it_was(doc):
    before = summary(doc)

    write(doc, "retention", "## Retention pass", "retention", [])

    assert summary(doc) == before


def test_a_missing_file_is_made_with_an_empty_summary_and_the_section(tmp_path):
    path = tmp_path / "benchmarks.md"

    write(path, "claim", CLAIM, "claim", [claim_figure("0.8x", True)])

    assert summary(path) == [summary_row("claim", CLAIM, claim_figure("0.8x", True))]


def test_a_rows_link_is_its_sections_anchor():
    row = summary_row("gang-start", "## Gang-start latency", claim_figure("1x", True))
    assert row[0] == "[claim / floor, 8 members](#gang-start-latency)"
    row = summary_row("x", "## Dispatch pass (1,000 x 5,000)", claim_figure("1x", True))
    assert row[0].endswith("(#dispatch-pass-1000-x-5000)")


@pytest.mark.parametrize("p", [5, 50, 90, 95, 99])
def test_the_percentile_is_linear_between_the_closest_ranks(p):
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(xs, p) == pytest.approx(
        statistics.quantiles(xs, n=100, method="inclusive")[p - 1]
    )
    assert percentile(xs, 50) == statistics.median(xs)
    assert percentile([7.0], p) == 7.0
