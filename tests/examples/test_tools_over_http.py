"""examples/tools_over_http.py against a live `orchestra serve` on a tiny family home: the model's call comes back
with JSON arguments, the script runs it and sends the result, and a final answer comes back over the cached
document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples import tools_over_http
from tests.waiting import HANG_GUARD_S

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tools_over_http.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_the_call_is_run_and_its_result_sent_back_before_the_final_answer(tiny_server, short_document_file, tmp_path):
    transcript = tmp_path / "transcript.json"
    done = run_script("--base-url", f"{tiny_server.base_url}/v1", "--model", "root", "--document",
                      str(short_document_file), "--transcript", str(transcript))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(transcript.read_text())

    # 1. the server returned a call of the offered function, with arguments that parse and follow its schema
    first = record["first"]["reply"]["choices"][0]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    (call,) = first["message"]["tool_calls"]
    assert call["function"]["name"] == "find_passages" and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"word"} and isinstance(arguments["word"], str) and len(arguments["word"]) <= 24
    assert record["tool"]["arguments"] == arguments
    assert record["tool"]["result"] == tools_over_http.find_passages(short_document_file.read_text(), arguments["word"])

    # 2. the call and its result went back to the server, answering that call's id
    sent = record["final"]["messages"]
    assert sent[-2] == {"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function", "function": {
        "name": "find_passages", "arguments": call["function"]["arguments"]}}]}
    assert sent[-1] == {"role": "tool", "tool_call_id": call["id"], "content": record["tool"]["result"]}

    # 3. a final assistant message, no further call, over the document the first request cached
    final = record["final"]["reply"]
    message = final["choices"][0]["message"]
    assert message["role"] == "assistant" and not message.get("tool_calls") and message["content"].strip()
    assert record["answer"] == message["content"]
    assert final["usage"]["prompt_tokens"] > record["first"]["reply"]["usage"]["prompt_tokens"] // 2
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > 200  # the document was not prefilled again
    assert f"call: find_passages({json.dumps(arguments)})" in done.stdout and "answer: " in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--document", "/no/such/file.txt"], "error: --document /no/such/file.txt is not a file"),
    (["--base-url", "http://127.0.0.1:9/v1"], "error: no server answers at http://127.0.0.1:9/v1"),
])
def test_a_missing_document_or_server_is_one_line_and_exit_2(args, message, capsys):
    assert tools_over_http.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_an_unknown_model_is_the_servers_404_in_one_line(tiny_server, short_document_file, capsys):
    assert tools_over_http.main(["--base-url", f"{tiny_server.base_url}/v1", "--model", "gpt-4o",
                                 "--document", str(short_document_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the server answered 404") and "gpt-4o" in err[0], err
