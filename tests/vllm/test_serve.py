"""`orchestra serve --engine vllm`: one address for the family, each member on its own vLLM engine (the root's
with a LoRA adapter), and a document computed on one member answered on another, and on the adapter, from the
mapped cache, through the official client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from orchestra.serve import free_port
from tests.fixtures.adapters import make_lora_adapter
from tests.waiting import wait_for_exit, wait_until

DOCUMENT = ("The committee reviewed the annual report and found that revenue grew in every region. "
            "Costs fell as the new plant came online, and the board approved a dividend. ") * 4


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(calibrated_family: dict, tmp_path_factory: pytest.TempPathFactory):
    import shutil

    home = tmp_path_factory.mktemp("serve") / "home"  # a store of its own: nothing computed yet
    shutil.copytree(calibrated_family["home"], home, ignore=shutil.ignore_patterns("kv"))
    legal = make_lora_adapter(calibrated_family["tiny"].parent, home.parent / "legal", scale=0.05, seed=1,
                              targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    port = free_port()
    log = open(home.parent / "serve.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestra", "serve", "--engine", "vllm", "--home", str(home), "--port", str(port),
         "--vllm-max-model-len", "512", "--vllm-arg=--enforce-eager", "--log-format", "console",
         f"--vllm-adapter=legal={legal}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    # the front starts answering only once every engine answers
    try:
        wait_until(lambda: _healthy(url), what="orchestra serve --engine vllm answering", alive=process)
    except AssertionError:
        raise AssertionError((home.parent / "serve.log").read_text(errors="replace")[-4000:]) from None
    yield {"url": url, "process": process, "home": home}
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        wait_for_exit(process)


def test_a_document_computed_on_one_member_is_served_mapped_on_another_through_the_openai_client(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key="none")
    assert {m.id for m in client.models.list().data} == {"base", "tuned", "legal"}
    first = client.completions.with_raw_response.create(model="root", prompt=DOCUMENT + " Revenue", max_tokens=8,
                                                        temperature=0)
    assert first.headers["x-orchestra-member"] == "base"  # a member by its role
    assert first.headers["x-orchestra-cache"] == "none"  # nothing stored yet: vLLM computes it, the store keeps it
    second = client.completions.with_raw_response.create(model="tuned", prompt=DOCUMENT + " Costs", max_tokens=8,
                                                         temperature=0)
    assert second.headers["x-orchestra-cache"] == "mapped"
    assert second.headers["x-orchestra-cache-source"] == "base"
    assert "offline=pass" in second.headers["x-orchestra-gates"]
    completion = second.parse()
    assert completion.choices[0].text  # answered
    cached = completion.usage.prompt_tokens_details.cached_tokens if completion.usage.prompt_tokens_details else 0
    assert cached >= int(second.headers["x-orchestra-cached-tokens"]) > 300  # vLLM counts the loaded tokens
    # the adapter runs in the root's engine, whose own prefix cache keys blocks by LoRA: the connector maps it
    third = client.completions.with_raw_response.create(model="legal", prompt=DOCUMENT + " The board", max_tokens=8,
                                                        temperature=0)
    assert third.headers["x-orchestra-member"] == "legal"
    assert (third.headers["x-orchestra-cache"], third.headers["x-orchestra-cache-source"]) == ("mapped", "base")
    assert int(third.headers["x-orchestra-cached-tokens"]) > 300 and third.parse().choices[0].text


def test_an_unknown_model_is_a_404_naming_the_served_members(server) -> None:
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key="none")
    with pytest.raises(NotFoundError, match="base, tuned, legal"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_sigterm_stops_the_server_and_every_vllm_engine(server) -> None:
    process = server["process"]
    assert _engines_of(server["home"])  # each member's vLLM server, naming the home in its connector config
    os.kill(process.pid, signal.SIGTERM)
    wait_for_exit(process)
    assert process.returncode == 0
    assert not _engines_of(server["home"])


def _engines_of(home: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline and str(home) in cmdline:
            found.append(int(proc.name))
    return found
