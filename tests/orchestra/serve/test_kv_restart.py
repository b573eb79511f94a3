"""`orchestra serve --kv-store`: a document cached before a restart is read back after it, not prefilled."""

from __future__ import annotations

import signal

import httpx

from orchestra.family.corpus import data_text
from orchestra.familycache import KVStore
from tests.waiting import HANG_GUARD_S

DOC = data_text("gpl-3.txt")[:400]


def _ask(base_url: str, question: str) -> httpx.Response:
    body = {"model": "root", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}]}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)


def test_a_restarted_server_serves_a_document_cached_before_the_restart(tiny_family_home, server_factory, tmp_path):
    kv = tmp_path / "kv"
    first = server_factory(tiny_family_home, "--kv-store", str(kv))
    cold = _ask(first.base_url, "Who may copy it?")
    assert cold.status_code == 200, cold.text
    assert first.metric("orchestra_kv_disk_loads_total") == 0
    assert first.stop(signal.SIGTERM) == 0  # shutdown finishes the queued writes
    assert KVStore(kv).entries(), "nothing was written to the disk tier"

    second = server_factory(tiny_family_home, "--kv-store", str(kv))
    warm = _ask(second.base_url, "Who may copy it?")
    assert warm.status_code == 200, warm.text
    assert second.metric("orchestra_kv_disk_loads_total", kind="exact") == 1
    assert second.metric("orchestra_kv_disk_load_seconds_total") > 0
    usage = warm.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16  # only the tail computed
    assert warm.json()["choices"][0]["message"]["content"] == cold.json()["choices"][0]["message"]["content"]
    assert second.metric("orchestra_kv_disk_bytes") > 0
