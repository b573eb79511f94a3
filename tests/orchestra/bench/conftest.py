from __future__ import annotations

import re

import pytest

from orchestra.bench.qa import load_qa
from orchestra.family.corpus import data_text
from tests.tiny_family import build_tiny_family

# Short enough for tiny models (512 positions), long enough for two windows at every length used.
TINY_PAIRS = ["base>child", "child>base"]
TINY_LENGTHS = [48, 96]
# The tiny models have a 320-token vocabulary (about 2 characters a token) and 512 positions, and the
# question_answerer's suffix alone takes ~400 of them: tiny runs ask these questions on passages cut down
# to their first answer +- 30 characters (a QA file of the bundled format, see tiny_qa_file).
TINY_QUESTIONS = ["gpl3-version", "gpl3-date", "apache-version", "mpl-lgpl-version", "mpl-effective-date"]


@pytest.fixture(scope="module")
def tiny_bench_family(tiny_root, tmp_path_factory):
    """A BenchFamily over the tiny llama parent/child with an empty mapping store (both directions calibrate)."""
    import torch

    from orchestra.bench import BenchFamily

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tiny_results
    try:
        fam = build_tiny_family(tiny_root, "llama")
    finally:
        torch.set_num_threads(threads)
    corpus = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
    return BenchFamily.from_models(
        {"base": str(fam.parent), "child": str(fam.child)}, tmp_path_factory.mktemp("bench-maps"),
        document=data_text("gpl-3.txt")[:12000], document_name="gpl-3.txt", corpus=corpus, calibration_tokens=1024,
    )


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from orchestra.bench import BenchConfig

    return BenchConfig(
        quick=True, pairs=TINY_PAIRS, lengths=TINY_LENGTHS, repeats=2, windows=2, suffix_tokens=16,
        greedy_tokens=8, tail_tokens=8, task_tokens=40, task_max_new_tokens=8, pipeline_agents=[2],
        qa_questions=TINY_QUESTIONS[:2], qa_file=str(tiny_qa_file(tmp_path_factory.mktemp("qa") / "qa.json")),
        pipeline_tokens=64, pipeline_max_new_tokens=4, calibration_tokens=256, calibration_window=64,
        repair_length=96, repair_budgets=[0.1, 0.5],
        # budgets in multiply-adds: a tiny model's pass costs about its whole 96-token prefill in seconds, so
        # measured pricing would buy no tokens (tests/mappings/test_passcost.py covers it)
        repair_costs="compute",
    )


@pytest.fixture(scope="module")
def tiny_results(tiny_bench_family, tiny_config, tmp_path_factory):
    """One whole bench run on the tiny family (every section), written to a scratch folder."""
    import torch

    from orchestra.bench import run_bench

    out = tmp_path_factory.mktemp("bench-out")
    # Tiny matmuls on a busy 2-core machine spend most of their time synchronising threads: one thread
    # makes this run ~30x faster. Restored afterwards so other tests keep their setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_bench(tiny_config, out, family=tiny_bench_family, command="orchestra bench --quick (tiny test)",
                           progress=False)
    finally:
        torch.set_num_threads(threads)
    return result, out


def tiny_qa_file(path, questions=TINY_QUESTIONS):
    """The bundled QA set's ``questions``, each passage cut to its questions' first answer +- 30 characters."""
    qa = load_qa()
    passages = []
    for p in qa.passages:
        text = qa.passage_text(p.id)
        qs = [q for q in qa.questions if q.passage == p.id and q.id in questions]
        if not qs:
            continue
        hits = [re.search(r"\s+".join(map(re.escape, q.answers[0].split())), text, re.IGNORECASE) for q in qs]
        a = max(0, min(h.start() for h in hits if h) - 30)
        z = min(len(text), max(h.end() for h in hits if h) + 30)
        passages.append(p.model_copy(update={"start": p.start + a, "end": p.start + z}))
    data = qa.model_copy(update={"passages": passages,
                                 "questions": [q for q in qa.questions if q.id in questions]})
    path.write_text(data.model_dump_json(indent=1))
    return path
