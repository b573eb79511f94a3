"""A live `orchestra serve` asked to stop (SIGTERM, or Ctrl+C's SIGINT) finishes its in-flight request and exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.waiting import HANG_GUARD_S, wait_until

pytestmark = pytest.mark.real_model

BODY = {"model": "root", "messages": [{"role": "user", "content": "Write a short poem about licences."}],
        "max_tokens": 24, "temperature": 0}


@pytest.mark.parametrize(("sig", "stream"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_in_flight_request_and_exits_0(real_family, server_factory, sig, stream):
    server = server_factory(real_family.home, "--graceful-shutdown", "60")
    outcome: dict[str, object] = {}

    def ask() -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**BODY, "stream": stream},
                              timeout=HANG_GUARD_S) as response:
                outcome["status"] = response.status_code
                outcome["body"] = response.read().decode()
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)

    client = threading.Thread(target=ask)
    client.start()
    wait_until(lambda: server.metric("orchestra_running_generations") >= 1, what="the request to generate",
               alive=client)
    assert server.stop(sig) == 0, server.log.read_text()[-3000:]
    client.join(30)

    assert outcome.get("status") == 200, outcome
    body = str(outcome["body"])
    if stream:
        events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        reply = json.loads(body)
        assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["usage"]["completion_tokens"] > 0
    log = server.log.read_text()
    assert "Application shutdown complete" in log and '"event": "shutdown"' in log
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.base_url}/healthz", timeout=2)
