"""`dtype: auto` and members in bfloat16: what a member computes in, what it is expected to take in memory, and a
pipeline whose members compute in bfloat16 on the CPU (maps fitted in float32, applied in the member's dtype)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from orchestra.family.corpus import data_text
from orchestra.familycache.gates import GatePolicy
from orchestra.models.registry import ModelRegistry, parameter_count, resolve_dtype
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra

DOC = data_text("gpl-3.txt")[:320]


def test_auto_is_float32_without_cuda_and_an_explicit_dtype_is_kept():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: scripts/gpu_check.py covers auto there")
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "auto") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert ModelRegistry({"m": "x"}).dtype_of("m") == "float32"  # the default is auto


@pytest.fixture(scope="module")
def bf16_parent(fam, tmp_path_factory) -> Path:
    """The tiny parent saved as a bfloat16 checkpoint (files half the size of its float32 ones)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16") / "parent-bf16"
    model = AutoModelForCausalLM.from_pretrained(fam.parent, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(fam.parent).save_pretrained(out)
    return out


def test_the_memory_estimate_counts_parameters_at_the_load_dtype_not_file_bytes(fam, bf16_parent):
    params = parameter_count(bf16_parent)
    assert params == sum(p.numel() for p in torch.nn.Module.parameters(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(fam.parent)))
    files = sum(f.stat().st_size for f in bf16_parent.glob("*.safetensors"))
    as_fp32 = ModelRegistry({"m": str(bf16_parent)}, dtype="float32", default_device="cpu")
    as_bf16 = ModelRegistry({"m": str(bf16_parent)}, dtype="bfloat16", default_device="cpu")
    assert as_fp32.load_estimate("m") == int(params * 4 * 1.1)  # about twice the files: a bf16 checkpoint upcast
    assert as_fp32.load_estimate("m") > 1.9 * files
    assert as_bf16.load_estimate("m") == int(params * 2 * 1.1)
    loaded = as_fp32.load("m")
    assert next(loaded.model.parameters()).dtype == torch.float32 and loaded.dtype == "float32"


@pytest.mark.filterwarnings("ignore:no mapping for")  # calibrated on demand (in float32) as a first run does
async def test_a_pipeline_in_bfloat16_on_the_cpu_prefills_once_and_maps_in_bfloat16(fam, tmp_path, mapstore):
    child = Path(shutil.copytree(fam.child, tmp_path / "child", ignore=shutil.ignore_patterns(".*")))
    agents = [{"name": n, "model": m, "spec": {"role": "You are careful.", "task": "Summarise the document.",
                                              "generation": {"max_new_tokens": 4, "temperature": 0.0}}}
              for n, m in (("a", "parent"), ("b", "child"))]
    spec = PipelineSpec.model_validate({
        "name": "bf16", "models": {"parent": str(fam.parent), "child": str(child)}, "source": "parent",
        "default_device": "cpu", "dtype": "bfloat16", "agents": agents,
        "gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}}})
    orch = Orchestra(spec, mappings=mapstore)
    report = await orch.run(DOC)
    assert [a.status for a in report.agents] == ["succeeded", "succeeded"], report.agents
    assert report.agent("b").cache_path == "mapped"
    assert [c.model for c in report.caches if c.path == "exact"] == ["parent"]
    gate = GatePolicy.model_validate({"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}})
    ids = orch.cache.executor.tokenizer("child")(DOC)["input_ids"]
    lease = await orch.cache.acquire("child", ids, gate=gate)
    try:
        assert lease.path == "mapped"
        assert lease.local_cache().layers[0].keys.dtype == torch.bfloat16  # applied in the member's dtype
    finally:
        lease.release()
