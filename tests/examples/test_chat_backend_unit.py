"""Chat backend pieces that need no model: SSE framing, settings, error bodies, app start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from examples.chat_backend.config import ChatConfig
from examples.chat_backend.engine import render_conversation
from examples.chat_backend.errors import ContextFull, SessionNotFound, UnknownModel
from examples.chat_backend.schemas import DocumentIn
from examples.chat_backend.sse import encode_event, parse_events

REPO = Path(__file__).resolve().parents[2]


def test_sse_frames_round_trip_with_newlines_and_unicode():
    frames = encode_event(0, "token", {"text": "a\nb ü", "index": 0}) + encode_event(1, "done", {"reply": "x"})
    assert frames.decode().startswith("id: 0\nevent: token\ndata: {")
    assert parse_events(frames.decode()) == [("token", {"text": "a\nb ü", "index": 0}), ("done", {"reply": "x"})]


class _Tokenizer:
    """Characters as token ids; a ChatML template when given one."""

    bos_token = "<s>"

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, turns, tokenize: bool, add_generation_prompt: bool) -> str:
        body = "".join(f"<|{t['role']}|>{t['content']}\n" for t in turns)
        return self.bos_token + body + ("<|assistant|>" if add_generation_prompt else "")


def _text(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_conversation_rendering_never_repeats_the_bos_and_extends_turn_by_turn():
    messages = [{"role": "user", "content": "hi"}]
    chat = _text(render_conversation(_Tokenizer("chatml"), "be brief", messages))
    assert chat == "<|system|>be brief\n<|user|>hi\n<|assistant|>"  # the BOS belongs before the document
    plain = _text(render_conversation(_Tokenizer(), "be brief", messages))
    assert plain == "\n### System\nbe brief\n\n### User\nhi\n\n### Assistant\n"
    # the next turn's ids start with this turn's (but the opener's end): the FamilyCache reuses them
    later = messages + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    again = _text(render_conversation(_Tokenizer("chatml"), "be brief", later))
    assert again.startswith(chat)


def test_errors_carry_status_and_type():
    assert SessionNotFound("x").body() == {"error": {"type": "session_not_found", "message": "x", "status": 404}}
    assert UnknownModel("m").status == 422 and ContextFull("c").status == 409


def test_document_body_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        DocumentIn(text="a", bundled="gpl-3.txt")
    with pytest.raises(ValueError, match="exactly one"):
        DocumentIn()


def test_config_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRA_HOME", str(tmp_path))
    monkeypatch.setenv("ORCHESTRA_CHAT_DEVICE", "cpu")
    monkeypatch.setenv("ORCHESTRA_CHAT_ON_MISSING_MAPPING", "calibrate")
    config = ChatConfig.from_env()
    assert config.home == tmp_path and config.device == "cpu" and config.on_missing_mapping == "calibrate"


def test_importing_the_app_loads_no_model_code():
    code = "import sys, examples.chat_backend.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


async def test_a_missing_family_is_a_503_not_a_crash(tmp_path):
    from examples.chat_backend.app import create_app

    app = create_app(ChatConfig(home=tmp_path / "nowhere"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://chat") as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        r = await client.get("/models")
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
        assert "orchestra family build" in r.json()["error"]["message"]
