"""benchmarks/served_tail.py: the table reads each tail's scores and costs, and names the map it scored."""

from __future__ import annotations

from tests.benchmarks.conftest import load_script


def test_table_reads_each_tail_and_names_the_map():
    st = load_script("served_tail")

    def split(kl, top1, cost, measured):
        return {"kl": kl, "top1": top1, "sinks_kl": 0.0119, "sinks_top1": 0.945, "planned_cost": cost,
                "measured_cost": measured}

    res = {"member": "finetuned", "method": "anchored_kl", "calibration_tokens": 8192,
           "calibrated_at": "2026-12-07T03:40:30+00:00",
           "rows": [{"tail": 32, "test": split(0.0107, 0.961, 0.013, 0.02), "dev": split(0.0084, 0.984, 0.013, 0.02)},
                    {"tail": 64, "test": split(0.0084, 0.965, 0.025, None), "dev": split(0.0080, 0.984, 0.025, None)}]}
    md = st.markdown(res, "python benchmarks/served_tail.py")
    assert "fitted on 8,192 tokens" in md
    assert "Without a tail (sinks only): test 0.0119 / 0.945" in md
    assert "| 32 | 0.0107 / 0.961 | 0.0084 / 0.984 | 1.3% | 2.0% |" in md
    assert "| 64 | 0.0084 / 0.965 | 0.0080 / 0.984 | 2.5% | - |" in md
    # the sinks-only line sits above the table, not inside it
    assert md.index("Without a tail") < md.index("| tail |")
