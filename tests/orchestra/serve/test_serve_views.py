"""`orchestra serve --adapter / --quantized`: a LoRA adapter and an int8 view served as members of their own, each
reaching a document the family computed through a map."""

from __future__ import annotations

import importlib.util

import pytest

from orchestra.serve import ServeConfig, ServeEngine
from tests.fixtures.adapters import make_lora_adapter
from tests.orchestra.serve.conftest import asgi_client
from tests.tiny_family import build_tiny_family

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
DOCUMENT = ("The committee reviewed the annual report and found that revenue grew in every region. "
            "Costs fell as the new plant came online, and the board approved a dividend. ") * 3


@pytest.fixture(scope="module")
def served_home(tiny_root, tmp_path_factory):
    from orchestra.family.init import init_family

    fam = build_tiny_family(tiny_root, "llama")
    tmp = tmp_path_factory.mktemp("views")
    init_family("tiny", [f"base={fam.parent}", f"tuned={fam.child}"], home=tmp / "home")
    return {"home": tmp / "home", "legal": make_lora_adapter(fam.parent, tmp / "legal", scale=0.02, seed=1)}


def ask(model: str, question: str) -> dict:
    return {"model": model, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]}


async def test_an_adapter_and_an_int8_view_are_served_and_map_the_document_the_root_computed(served_home):
    quantized = {"root-int8": "root:int8"} if HAS_TORCHAO else {}
    engine = ServeEngine(ServeConfig(home=served_home["home"], device="cpu", dtype="float32",
                                     adapters={"legal": str(served_home["legal"])}, quantized=quantized,
                                     on_missing_mapping="calibrate"))
    try:
        async with asgi_client(engine) as client:
            cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert cards["legal"]["role"] == "adapter" and cards["legal"]["parent"] == "root"
            if HAS_TORCHAO:
                assert cards["root-int8"]["role"] == "quantized" and cards["root-int8"]["parent"] == "root"
            first = await client.post("/v1/chat/completions", json=ask("root", "Revenue?"))
            assert first.status_code == 200, first.text
            for model in ["legal", *quantized]:
                reply = await client.post("/v1/chat/completions", json=ask(model, "Costs?"))
                assert reply.status_code == 200, reply.text
                assert reply.headers["x-orchestra-cache"] == "mapped", (model, dict(reply.headers))
                assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    finally:
        engine.close()


@pytest.mark.parametrize(("settings", "says"), [
    ({"adapters": {"tuned": "x"}}, "already a member's id or name"),
    ({"quantized": {"q8": "nobody:int8"}}, "which is no member of the family"),
])
def test_a_view_that_clashes_or_has_no_base_is_refused_at_start(served_home, settings, says):
    from orchestra.errors import ModelReferenceError

    with pytest.raises(ModelReferenceError, match=says):
        ServeEngine(ServeConfig(home=served_home["home"], device="cpu", **settings))


def test_a_malformed_quantized_view_names_the_form():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="write BASE:SCHEME"):
        ServeConfig(quantized={"q8": "int8"})


def test_a_malformed_adapter_option_is_one_line_and_exit_2():
    from typer.testing import CliRunner

    from orchestra.cli import app

    result = CliRunner().invoke(app, ["serve", "--adapter", "legal"])
    assert result.exit_code == 2
    assert "--adapter 'legal': write NAME=VALUE" in result.output and "Traceback" not in result.output
