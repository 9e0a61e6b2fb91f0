"""benchmarks/ttft.py on the tiny preset: jpaged's first tokens equal transformers' on the same
weights, nothing compiles while timing, and each case runs at the budgets that chunk it
differently."""

import pytest

from benchmarks import ttft

pytest.importorskip("transformers")

# a prompt of two chunks at 128, and 3 prompts of 64 (two steps at 128, one at 256)
ARGV = ["--model", "tiny", "--dtype", "float32", "--cases", "200,3x64",
        "--max-num-batched-tokens", "256,128,1024", "--repeats", "1"]


def test_cases_parse_and_budgets_stop_at_the_first_that_holds_the_case():
    assert ttft.parse_case("16x8k") == ttft.Case("16x8k", 16, 8192)
    assert ttft.parse_case("3x64") == ttft.Case("3x64", 3, 64)
    assert ttft.parse_case("40").num_tokens == 40
    with pytest.raises(ValueError, match="<B>x<T>"):
        ttft.parse_case("8kx2")
    assert ttft.budgets_for(ttft.CASES["1k"], [32768, 2048, 8192]) == [2048]
    assert ttft.budgets_for(ttft.CASES["16x8k"], [2048, 8192, 32768]) == [2048, 8192, 32768]
    assert ttft.budgets_for(ttft.CASES["32k"], [2048, 8192]) == [2048, 8192]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("ttft") / "ttft.md"
    text = ttft.main(ARGV + ["--out", str(out)])
    assert out.read_text() == text
    return text


def test_table_rows_match_first_tokens_and_compile_nothing_while_timing(table):
    lines = table.splitlines()
    assert lines[0].startswith("device: cpu") and lines[1].startswith("command: python "
                                                                       "benchmarks/ttft.py")
    rows = [line for line in lines if line.startswith("| 200") or line.startswith("| 3x64")]
    # 200 tokens: 128 (two chunks), 256 (one step); 3 x 64 = 192: the same two budgets
    assert [row.split("|")[2].strip() for row in rows] == ["128", "256", "128", "256"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        ours, theirs, ratio = float(cells[2]), float(cells[3]), float(cells[4])
        # the times are printed to 0.1 ms and the ratio from the unrounded times to 0.01
        half = 0.05
        assert ours > 0 and theirs > half
        assert (ours - half) / (theirs + half) - 0.005 <= ratio <= (ours + half) / (theirs - half) + 0.005
        assert "COMPILED" not in cells[5]
    assert rows[0].endswith("| first tokens equal 1/1 |")
    assert rows[2].endswith("| first tokens equal 3/3; torch: forwards of 3 prompts |")


def test_a_deadline_skips_measurements_and_says_so():
    text = ttft.main(ARGV[:4] + ["--cases", "40", "--no-hf", "--deadline", "0"])
    (row,) = [line for line in text.splitlines() if line.startswith("| 40")]
    assert row.endswith("| - | - | - | jpaged: skipped: deadline |")
