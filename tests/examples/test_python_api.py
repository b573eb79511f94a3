"""examples/python_api.py on the real family: two agents, two members, one document prefill."""

from __future__ import annotations

import pytest

from examples import python_api

pytestmark = pytest.mark.real_model


def test_python_api_runs_two_agents_over_one_prefill(real_family, short_document_file, capsys):
    report = python_api.main(["--document", str(short_document_file), "--max-new-tokens", "12"])

    assert report.succeeded == ["summary", "review"], [(a.name, a.error) for a in report.agents]
    assert report.agent("summary").cache_path == "exact"
    review = report.agent("review")
    assert review.model == "tuned" and review.cache_path in {"mapped", "reprefilled"}
    assert {g["gate"] for g in review.gate} == {"offline", "probe"}
    assert (review.cache_path == "reprefilled") == (review.fallback_reason is not None)
    # the document was prefilled once, on the source; the other member got it mapped (or re-prefilled by a gate)
    assert [c.model for c in report.caches if c.path == "exact"] == ["root"]
    assert all(a.output.strip() and 0 < a.tokens <= 12 for a in report.agents)

    out = capsys.readouterr().out
    assert "== summary on root (succeeded, cache: exact)" in out
    assert f"== review on tuned (succeeded, cache: {review.cache_path})" in out
    assert report.agent("summary").output in out and "prefill seconds spent" in out
