"""The demo's chunked pipeline (`long.yaml`) on a document it was not written for, on the bundled family:
every agent's output reads (no line said twice, no JSON or sentence cut off) and the reduce reads items."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from orchestra import Pipeline

ROOT = Path(__file__).resolve().parents[3]
LONG = ROOT / "examples" / "long_document_analysis" / "long.yaml"
DOCUMENT = ROOT / "tests" / "fixtures" / "lgpl-2.1-head.txt"  # the LGPL-2.1's first ~1,300 tokens
_LABEL = re.compile(r"^\[chunk \d+/\d+[^\]]*\]$")
_ENDS = re.compile(r"[.!?:;)\]\"\u201d]$")


def _calls(output: str) -> list[str]:
    """A chunked agent's output split into its calls' outputs (each under its chunk label)."""
    parts: list[list[str]] = []
    for line in output.splitlines():
        if _LABEL.match(line.strip()):
            parts.append([])
        elif parts:
            parts[-1].append(line)
        else:
            parts.append([line])
    return ["\n".join(p).strip() for p in parts]


def test_the_long_pipeline_on_an_unseen_document_neither_repeats_nor_stops_mid_answer(real_family, tmp_path):
    settings = yaml.safe_load(LONG.read_text())
    # the family's calibrated maps as the test session holds them (root -> finetuned at 4,096 tokens); the int8
    # member's missing map is refused and its agent re-prefills: calibrating pairs here would cost minutes
    settings["mapping"] = {"directory": str(Path(real_family.home) / "mappings"), "on_missing": "refuse",
                           "tokens": 4096}
    settings["chunking"]["window_tokens"] = 1024  # two chunks of a shorter excerpt: the same calls, half the prefill
    pipeline_file = tmp_path / "long.yaml"
    pipeline_file.write_text(yaml.safe_dump(settings))
    report = Pipeline.from_file(pipeline_file, family=real_family).run_sync(DOCUMENT.read_text())

    assert {a.name: a.status for a in report.agents} == {n: "succeeded" for n in ("summary", "facts", "answer",
                                                                                     "report")}
    assert [c.index for c in report.agent("facts").chunks] == [0, 1]
    for agent in report.agents:
        lines = [" ".join(line.split()) for line in agent.output.splitlines()]
        said = [line.lower() for line in lines if len(line.split()) >= 4]
        assert len(said) == len(set(said)), (agent.name, agent.output)
        for call in _calls(agent.output):
            if agent.name == "facts":
                facts = json.loads(call)["facts"]  # each call's JSON is whole (its items new to the output)
                assert len({f.lower() for f in facts}) == len(facts), call
            else:
                assert _ENDS.search(call), (agent.name, call)  # ends on a whole sentence
    merged = report.agent("facts").parsed["facts"]
    assert merged and len({f.lower() for f in merged}) == len(merged)
    # the reduce read the facts as items, not as JSON to copy
    assert "{" not in report.agent("report").output and '"facts"' not in report.agent("report").output
