"""What benchmarks/tp_scaling.py and collective_share.py read and report: run lists, throughput
tables read back (from a directory or the committed 2-GPU results), the kernel-name classes of the
all-reduce share, and the table's marks for TP = 1, CPU profiles and missing runs."""

from pathlib import Path

import pytest

from benchmarks import collective_share, tp_scaling

ROOT = Path(__file__).resolve().parent.parent
REPORT = """device: NVIDIA H200, date 2026-11-30, jax 0.11.2, python 3.12.3
measured copy bandwidth 4.10 TB/s (read + write)
INCOMPLETE: interrupted after 100.0 s

| metric | value |
|---|---:|
| output tokens/s | 426 |
| output tokens/s excluding compile | 1499 |
| mean decode step, device (ms) | 43.71 |
| mean decode floor (ms) | 27.33 |
| decode time / floor | 1.60 |
| compile time inside the run (s) | 139.9 |

| decode batch bucket | steps | mean step (ms) | mean floor (ms) | ratio |
|---:|---:|---:|---:|---:|
| 1 | 1 | 30.82 | 25.30 | 1.22 |
"""


def test_runs_expand_and_reject_a_missing_size():
    assert tp_scaling.parse_runs(["llama3-70b:2,4", "llama3-8b:1"]) == \
        [("llama3-70b", 2), ("llama3-70b", 4), ("llama3-8b", 1)]
    with pytest.raises(ValueError, match="MODEL:TP"):
        tp_scaling.parse_runs(["llama3-8b"])


def test_throughput_report_read_back_from_a_directory(tmp_path):
    (tmp_path / "throughput_llama3-70b_tp2.md").write_text(REPORT)
    (tmp_path / "tp_scaling.md").write_text("| output tokens/s | 1 |")   # not a run
    throughput, profiles = tp_scaling.read_reused([tmp_path])
    assert list(throughput) == [("llama3-70b", 2)] and profiles == {}
    row = throughput["llama3-70b", 2]
    assert (row["tokens_s"], row["tokens_s_warm"], row["step_ms"], row["floor_ms"],
            row["ratio"], row["compile_s"]) == (426, 1499, 43.71, 27.33, 1.60, 139.9)
    assert row["bandwidth_tb_s"] == 4.10 and row["is_complete"] is False
    assert (row["device"], row["date"]) == ("NVIDIA H200", "2026-11-30")


def test_committed_two_gpu_results_read_back_by_section():
    path = ROOT / "benchmarks/results/tp_scaling_h200x2.md"
    throughput, _ = tp_scaling.read_reused([path])
    assert sorted(throughput) == [("llama3-70b", 2), ("llama3-8b", 1), ("llama3-8b", 2)]
    assert throughput["llama3-70b", 2]["tokens_s_warm"] == 1499
    assert throughput["llama3-8b", 1]["step_ms"] == 10.36
    assert all(row["is_complete"] for row in throughput.values())


def test_kernel_names_classified():
    kind = collective_share.kernel_kind
    assert kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == "all_reduce"
    assert kind("all-reduce-start.1") == kind("xla_all_reduce_one_shot") == "all_reduce"
    assert kind("ncclDevKernel_AllGather_RING_LL") == kind("ncclDevKernel_Generic") \
        == "collective"
    assert kind("small_reduce_fusion") is kind("input_reduce_fusion") is None


def test_table_marks_tp1_cpu_profiles_and_missing_runs():
    profile = dict(all_reduce_share=None, collectives_share=None, num_layers=2,
                   full_num_layers=2, batch=4, mean_context=20.0, step_ms=2.0, busy_ms=None,
                   all_reduce_ms=None, collectives_ms=None)
    throughput = {("m", 1): tp_scaling.read_throughput(REPORT.replace("INCOMPLETE", ""))}
    lines = tp_scaling.tables([("m", 1), ("m", 2), ("m", 4)], throughput,
                              {("m", 2): profile})
    assert lines[2].startswith("| m | 1 | 426 | 1499 | 43.71 | 27.33 | 1.60 | 0 (no collectives)")
    assert lines[3].startswith("| m | 2 | not measured |") and "| n/a |" in lines[3]
    assert lines[4].startswith("| m | 4 | not measured |") and lines[4].count("not measured") == 2
    assert lines[-1].endswith("| n/a | n/a |")
