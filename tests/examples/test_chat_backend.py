"""examples/chat_backend/app.py on a tiny family home: the backend's own streaming route and orchestra's mounted
OpenAI app, served by uvicorn in a process of its own, as a user starts it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI

from examples.chat_backend import app as chat_backend
from orchestra.family.corpus import data_text
from orchestra.serve import free_port
from tests.waiting import HANG_GUARD_S, wait_for_exit, wait_until

APP = Path(__file__).resolve().parents[2] / "examples" / "chat_backend" / "app.py"


@pytest.fixture(scope="module")
def backend(tiny_home, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`python examples/chat_backend/app.py` over the tiny home on a free port, once it answers: its base URL and
    the document it was started with."""
    text = data_text("gpl-3.txt")[:1200]
    document = tmp_path_factory.mktemp("chat_backend") / "document.txt"
    document.write_text(text, encoding="utf-8")
    port = free_port()
    process = subprocess.Popen([sys.executable, str(APP), "--document", str(document), "--home", str(tiny_home),
                                "--device", "cpu", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/llm/healthz", timeout=HANG_GUARD_S).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, what="the chat backend to listen", alive=process, poll_s=0.2)
    yield SimpleNamespace(base=base, document=text)
    process.terminate()
    out = wait_for_exit(process).decode(errors="replace")
    assert process.returncode == 0, out[-2000:]


def ask(base: str, **body: object) -> list[tuple[str, dict]]:
    """`POST /ask`'s Server-Sent Events as (event, data), in the order they arrived."""
    events: list[tuple[str, dict]] = []
    kind = "message"
    with httpx.stream("POST", f"{base}/ask", json=body, timeout=HANG_GUARD_S) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                kind = "message"
    return events


def test_ask_streams_the_answer_in_pieces_after_saying_how_the_prompt_was_cached(backend):
    events = ask(backend.base, question="Who may copy this licence?", max_tokens=16)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "cache" and kinds[-1] == "done" and set(kinds[1:-1]) == {"message"}, kinds
    pieces = [data["text"] for kind, data in events if kind == "message"]
    assert len(pieces) >= 2 and "".join(pieces).strip()  # the answer came as several chunks, and says something
    cache, done = events[0][1], events[-1][1]
    assert cache["model"] == "root" and cache["path"] in {"exact", "mapped", "reprefilled"}
    assert 0 < done["completion_tokens"] <= 16 and done["finish_reason"] in {"stop", "length"}
    assert done["prompt_tokens"] > 200  # the document is in the prompt

    # another question about the same document: its prefix comes from the cache, not prefilled again
    again = ask(backend.base, question="What must I keep when I pass it on?", max_tokens=4)
    assert again[0][0] == "cache" and again[0][1]["cached_tokens"] > done["prompt_tokens"] // 2, again[0]


def test_the_mounted_openai_app_answers_on_the_same_engine_and_cache(backend):
    ask(backend.base, question="Is this licence free?", max_tokens=2)  # the backend's route caches the document
    client = OpenAI(base_url=f"{backend.base}/llm/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
    assert {"root", "finetuned"} <= {m.id for m in client.models.list()}
    messages = [{"role": "system", "content": f"{chat_backend.INSTRUCTION}\n\n{backend.document}"},
                {"role": "user", "content": "Who wrote it?"}]
    raw = client.chat.completions.with_raw_response.create(model="root", messages=messages, max_tokens=6,
                                                           temperature=0)
    completion = raw.parse()
    assert completion.choices[0].message.content.strip()
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached > completion.usage.prompt_tokens // 2 and raw.headers["x-orchestra-cache"] == "exact"


def test_an_unknown_model_is_a_404_before_the_stream_starts(backend):
    response = httpx.post(f"{backend.base}/ask", json={"question": "hi", "model": "gpt-4o"}, timeout=HANG_GUARD_S)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_missing_document_is_one_line_and_exit_2(tmp_path, capsys):
    assert chat_backend.main(["--document", str(tmp_path / "absent.txt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --document {tmp_path / 'absent.txt'} is not a file"]
