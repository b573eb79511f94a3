"""examples/ab_test/run.py on the real family: shared prefill vs per-member prefill, side by side."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

RUN = Path(__file__).resolve().parents[2] / "examples" / "ab_test" / "run.py"


def _module():
    spec = importlib.util.spec_from_file_location("ab_test_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the result models' annotations through it
    spec.loader.exec_module(module)
    return module


def test_ab_test_compares_shared_and_own_prefill(real_family, short_document_file, tmp_path):
    ab = _module()
    out = tmp_path / "ab.json"
    questions = ["Who publishes this licence?", "Is this licence free?"]
    result = ab.main(["--document", str(short_document_file), "--questions", *questions,
                      "--members", "root", "finetuned", "--max-new-tokens", "8", "--device", "cpu",
                      "--json", str(out)])

    assert result.failures == []
    assert [c.member for c in result.costs] == ["root", "finetuned"]
    root, tuned = result.costs
    assert root.path == "exact" and root.gates == []
    assert tuned.path in {"mapped", "reprefilled"}
    assert any(g.endswith("offline") for g in tuned.gates) and any(g.endswith("probe") for g in tuned.gates)
    assert (tuned.path == "reprefilled") == (tuned.fallback_reason is not None)
    assert all(c.own_s > 0 and c.pipeline_shared_s > 0 and c.pipeline_baseline_s > 0 for c in result.costs)
    assert root.map_s is None and root.shared_s == root.own_s and root.ratio == 1.0
    assert tuned.map_s > 0
    assert tuned.shared_s == (tuned.map_s if tuned.path == "mapped" else tuned.map_s + tuned.own_s)

    assert len(result.answers) == 4 and {a.question for a in result.answers} == set(questions)
    assert all(a.shared.strip() and a.baseline.strip() for a in result.answers)
    for answer in result.answers:
        # the source reuses its own exact cache, and a re-prefill is the baseline itself: greedy answers agree
        if answer.path in {"exact", "reprefilled"}:
            assert answer.identical, answer

    payload = json.loads(out.read_text())
    assert payload["document_tokens"] == result.document_tokens > 200
    assert set(payload["ratios"]) == {"root", "finetuned"}
    assert payload["summary"]["baseline_total_s"] == pytest.approx(sum(c.own_s for c in result.costs))
    assert payload["shared_s"]["finetuned"] == pytest.approx(tuned.shared_s)

    from rich.console import Console

    buffer = io.StringIO()
    ab.render(result, Console(file=buffer, width=200))
    text = buffer.getvalue()
    assert "answer over the shared prefill" in text and "shared / own" in text and "prefill seconds saved" in text
    assert result.answers[0].shared.strip().split()[0] in text
