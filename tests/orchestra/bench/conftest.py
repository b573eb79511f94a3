from __future__ import annotations

import pytest

from orchestra.family.corpus import data_text
from tests.tiny_family import build_tiny_family

# Short enough for tiny models (512 positions), long enough for two windows at every length used.
TINY_PAIRS = ["base>child", "child>base"]
TINY_LENGTHS = [48, 96]


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
def tiny_config():
    from orchestra.bench import BenchConfig

    return BenchConfig(
        quick=True, pairs=TINY_PAIRS, lengths=TINY_LENGTHS, repeats=2, windows=2, suffix_tokens=16,
        greedy_tokens=8, tail_tokens=8, task_tokens=64, task_max_new_tokens=12, pipeline_agents=[2],
        pipeline_tokens=64, pipeline_max_new_tokens=4, calibration_tokens=256, calibration_window=64,
        repair_length=96, repair_budgets=[0.1, 0.5],
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
