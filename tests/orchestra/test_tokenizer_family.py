"""Family membership is decided by token ids: an instruct sibling (other eos/pad, another chat template) joins the
family; a member whose chat template lays the document out in other ids prefills it itself, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from orchestra.errors import CrossFamilyError
from orchestra.family.corpus import data_text
from orchestra.models.registry import ModelRegistry
from orchestra.observability.events import CacheReady, Fallback
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra
from tests.tokenizer_variants import model_folder, save_edited_tokenizer, save_instruct_tokenizer, swap_ids

DOC = data_text("gpl-3.txt")[:320]
GATE = {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}}


@pytest.fixture(scope="module")
def siblings(fam, tmp_path_factory) -> dict[str, Path]:
    """The child's weights under three tokenizers: other eos/pad only, the same plus a chat template, swapped ids."""
    root = tmp_path_factory.mktemp("siblings")
    return {
        "roles": model_folder(fam.child, root / "roles",
                              lambda out: save_instruct_tokenizer(fam.parent, out, chat_template=None)),
        "chat": model_folder(fam.child, root / "chat", lambda out: save_instruct_tokenizer(fam.parent, out)),
        "swapped": model_folder(fam.child, root / "swapped",
                                lambda out: save_edited_tokenizer(fam.parent, out, swap_ids("Ġthe", "Ġa"))),
    }


def _spec(name: str, model: str) -> dict:
    return {"name": name, "model": model,
            "spec": {"role": "You are careful.", "task": "Summarise the document.",
                     "generation": {"max_new_tokens": 6, "temperature": 0.0}}}


def _pipeline(fam, siblings, agents) -> PipelineSpec:
    models = {"base": str(fam.parent), **{a["model"]: str(siblings[a["model"]]) for a in agents if a["model"] != "base"}}
    return PipelineSpec.model_validate({"name": "t", "models": models, "source": "base", "default_device": "cpu",
                                        "agents": agents, "gate": GATE})


def test_registry_accepts_an_instruct_sibling_and_refuses_swapped_ids_naming_them(fam, siblings):
    ok = ModelRegistry({"base": str(fam.parent), "roles": str(siblings["roles"]), "chat": str(siblings["chat"])},
                       default_device="cpu")
    ok.check_family("base")
    assert ok.info("roles").tokenizer_digest == ok.info("base").tokenizer_digest
    assert ok.info("roles").fingerprint != ok.info("base").fingerprint
    bad = ModelRegistry({"base": str(fam.parent), "swapped": str(siblings["swapped"])}, default_device="cpu")
    with pytest.raises(CrossFamilyError) as err:
        bad.check_family("base")
    message = str(err.value)
    assert message.startswith("member swapped's tokenizer differs from the source's (base): 2 tokens with other ids")
    assert "'Ġthe'" in message and "members of one family must share a tokenizer" in message and "\n" not in message


@pytest.mark.filterwarnings("ignore:no mapping for")  # the pair is calibrated on demand, as intended
async def test_an_instruct_sibling_gets_the_source_cache_mapped(fam, siblings, mapstore):
    orch = Orchestra(_pipeline(fam, siblings, [_spec("a", "roles")]), mappings=mapstore)
    report = await orch.run(DOC)
    agent = report.agent("a")
    assert agent.status == "succeeded" and agent.cache_path == "mapped" and agent.fallback_reason is None
    assert [c.model for c in report.caches if c.path == "exact"] == ["base"]  # the document was prefilled once


async def test_a_member_with_another_chat_template_prefills_its_own_prefix_and_says_why(fam, siblings, mapstore):
    from agents import DocumentPrompt

    orch = Orchestra(_pipeline(fam, siblings, [_spec("a", "chat"), _spec("b", "base")]), mappings=mapstore)
    events: list = []
    report = await orch.run(DOC, on_event=events.append)
    agent = report.agent("a")
    assert agent.status == "succeeded" and agent.cache_path == "reprefilled"
    assert agent.fallback_reason is not None
    assert agent.fallback_reason.startswith("the member's chat template tokenizes the document prefix differently "
                                            "from the source's (first difference at token 0)")
    fallback = [e for e in events if isinstance(e, Fallback)]
    assert [(e.agent, e.model) for e in fallback] == [("a", "chat")] and fallback[0].reason == agent.fallback_reason
    ready = next(e for e in events if isinstance(e, CacheReady) and e.model == "chat")
    assert ready.path == "reprefilled"
    # its cache is its own prefill of its own layout: both members' prefixes were computed exactly
    assert sorted(c.model for c in report.caches if c.path == "exact") == ["base", "chat"]
    assert report.agent("b").cache_path == "exact"
    # the same agent without any sharing reads the same prompt: the same output
    alone = await Orchestra(_pipeline(fam, siblings, [_spec("a", "chat")]), mappings=mapstore,
                            share_prefill=False).run(DOC)
    assert alone.agent("a").output == agent.output and alone.agent("a").fallback_reason is None
    chat_ids = DocumentPrompt(DOC).token_ids(AutoTokenizer.from_pretrained(str(siblings["chat"])))
    assert agent.suffix_tokens > 0 and len(chat_ids) != report.document_tokens  # another layout, another length
