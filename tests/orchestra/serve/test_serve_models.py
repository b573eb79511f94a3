"""`orchestra serve MODEL...`: models served as a family without `family init`, the family made once and reused."""

from __future__ import annotations

import httpx

from tests.tiny_family import build_tiny_family
from tests.waiting import HANG_GUARD_S


def test_serving_folders_by_path_makes_their_family_once_and_answers_on_each(tiny_root, tmp_path, server_factory):
    from openai import OpenAI

    fam, other = build_tiny_family(tiny_root, "llama"), build_tiny_family(tiny_root, "mistral")
    args = (f"base={fam.parent}", f"tuned={fam.child}", f"other={other.parent}")
    server = server_factory(tmp_path / "home", *args)
    models = httpx.get(f"{server.base_url}/v1/models", timeout=HANG_GUARD_S).json()
    # the first is the root; the others share the role `external`, so each is served under its name
    assert sorted(m["id"] for m in models["data"]) == ["other", "root", "tuned"]
    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    for model in ("base", "root", "tuned", "other"):  # by name, and the first model by its role
        reply = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                               messages=[{"role": "user", "content": "Revenue grew in every region."}])
        assert reply.choices[0].message.content is not None
    server.process.terminate()
    server.process.wait(timeout=HANG_GUARD_S)
    manifests = list((tmp_path / "home" / "served").glob("*/family/family.json"))
    assert len(manifests) == 1
    written = manifests[0].stat().st_mtime_ns
    again = server_factory(tmp_path / "home", *args)  # the same models
    assert httpx.get(f"{again.base_url}/v1/models", timeout=HANG_GUARD_S).status_code == 200
    assert manifests[0].stat().st_mtime_ns == written  # reused, not initialised again
    assert len(list((tmp_path / "home" / "served").glob("*/family/family.json"))) == 1


def test_models_that_would_share_a_name_are_one_line_and_exit_2_naming_the_fix(tiny_root, tmp_path):
    from typer.testing import CliRunner

    from orchestra.cli import app

    llama = build_tiny_family(tiny_root, "llama")
    qwen = build_tiny_family(tiny_root, "qwen2")
    # both folders are called `parent`: a member's name comes from its folder unless given
    result = CliRunner().invoke(app, ["serve", "--home", str(tmp_path / "home"), str(llama.parent), str(qwen.parent)])
    assert result.exit_code == 2, result.output
    assert "two models would both be named 'parent': name them" in result.output
    assert "Traceback" not in result.output
