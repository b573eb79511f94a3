"""`orchestra serve` under load, measured from outside: a live server subprocess driven by async httpx clients.

    python benchmarks/serve_load.py [--clients 50] [--abandoned 200] [--cache-mb 1024] [--repeats 3] [--quick]

Phases, in one run (the server is started as users start it, on the bundled family, CPU):
1. headline: a member asks about a ~4k-token document already cached on another member (mapped) vs a cold
   prefill of the same document on that member; time to first token (TTFT) of each and their ratio;
2. load: `--clients` concurrent conversations of two short questions each over one shared ~2k-token document
   (a bundled licence text), half on root and half on finetuned, all starting at once, cold: all answered?
   p50/p95 TTFT, tokens/s, the cache path of each answer, the server's peak RSS;
3. throughput with 1 vs 8 concurrent clients (closed loop, same document, cached), with step-level batching;
4. memory: `--abandoned` distinct conversations opened and never continued; RSS before, during, after,
   against the `--cache-mb` budget;
5. throughput with 1 vs 8 clients again on a second server started with `--no-batch`.
Writes benchmarks/results/serve_load.json and serve_load.md (with the machine and the exact command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# -- the server --------------------------------------------------------------------------------------
class Server:
    """`python -m orchestra serve` on a free port, with its RSS sampled every 100 ms."""

    def __init__(self, log: Path, *args: str) -> None:
        import psutil

        from orchestra.serve import start_server

        self._t0 = time.monotonic()
        started = start_server(["--device", "cpu", *args], log=log, cwd=ROOT)
        self.process, self.base_url, self.log = started.process, started.base_url, log
        self.ps = psutil.Process(self.process.pid)
        self.peak_rss = 0
        self.held = 0
        """Cache bytes + decoding rows' bytes + entries in use beyond the budget (the server's /metrics), each second."""
        self.peak_held = 0
        self.held_at_peak = 0
        """`held` when RSS peaked: what of the peak the cache budget accounts for."""
        self.idle_rss = 0
        self.idle_kinds: dict[str, float] = {}
        """RSS once every member is loaded and warm, before any document: the models and the runtime."""
        self.timeline: list[dict[str, float]] = []
        """One sample a second: seconds since start, RSS and what the budget accounts for (cache, rows, outside)."""
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        tick = 0
        while not self._stop.is_set():
            if tick % 10 == 0:
                try:
                    m = self.metrics(timeout=2)
                    parts = {key: m.get(f"orchestra_{key}_bytes", 0.0)
                             for key in ("cache", "decode_reserved", "cache_outside")}
                    self.held = int(sum(parts.values()))
                    self.peak_held = max(self.peak_held, self.held)
                    self.timeline.append({"t": round(time.monotonic() - self._t0, 1),
                                          "rss": float(self.ps.memory_info().rss), **self.rss_kinds(), **parts})
                except Exception:  # busy or gone: keep the last reading
                    pass
            tick += 1
            try:
                rss = self.ps.memory_info().rss
            except Exception:  # the process is gone
                return
            if rss > self.peak_rss:
                self.peak_rss, self.held_at_peak = rss, self.held
            time.sleep(0.1)

    def rss_kinds(self) -> dict[str, float]:
        """Resident bytes by kind (Linux): anonymous (heap, tensors) and file-backed (mapped model weights)."""
        kinds: dict[str, float] = {}
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    kinds[key[3:].lower()] = float(value.split()[0]) * 1024
        except OSError:
            pass
        return kinds

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def reset_peak(self) -> None:
        self.peak_rss, self.peak_held, self.held_at_peak = self.rss(), self.held, self.held
        self.timeline.clear()

    def metrics(self, timeout: float = 30) -> dict[str, float]:
        """Every Prometheus sample, by its full name with labels."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(f"{self.base_url}/metrics", timeout=timeout).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> int:
        import signal

        self._stop.set()
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


# -- requests ----------------------------------------------------------------------------------------
@dataclass
class Answer:
    model: str
    status: int
    ttft_s: float | None = None
    seconds: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache: str | None = None
    source: str | None = None
    gates: str | None = None
    finish: str | None = None
    text: str = ""
    error: str | None = None


async def ask(client: Any, model: str, messages: list[dict], max_tokens: int) -> Answer:
    """One streamed request: TTFT is the time to the first chunk carrying text (or to the finish if none does)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    answer = Answer(model=model, status=0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            answer.status = response.status_code
            answer.cache = response.headers.get("x-orchestra-cache")
            answer.source = response.headers.get("x-orchestra-cache-source")
            answer.gates = response.headers.get("x-orchestra-gates")
            if response.status_code != 200:
                answer.error = (await response.aread()).decode()[:300]
                return answer
            pieces = []
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = chunk["error"]["message"]
                    continue
                for choice in chunk.get("choices") or []:
                    text = choice["delta"].get("content")
                    if (text or choice.get("finish_reason")) and answer.ttft_s is None:
                        answer.ttft_s = time.perf_counter() - started
                    pieces.append(text or "")
                    answer.finish = choice.get("finish_reason") or answer.finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    answer.completion_tokens = usage["completion_tokens"]
                    answer.prompt_tokens = usage["prompt_tokens"]
                    answer.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            answer.text = "".join(pieces)
    except Exception as exc:  # a failed request is counted, not fatal
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.seconds = time.perf_counter() - started
    return answer


def client_for(server: Server) -> Any:
    import httpx

    return httpx.AsyncClient(base_url=server.base_url, timeout=httpx.Timeout(3600.0),
                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(answers: list[Answer], wall_s: float) -> dict[str, Any]:
    ok = [a for a in answers if a.status == 200 and a.error is None and a.finish is not None]
    ttft = [a.ttft_s for a in ok if a.ttft_s is not None]
    tokens = sum(a.completion_tokens for a in ok)
    paths: dict[str, int] = {}
    for a in ok:
        key = f"{a.model}:{a.cache}"
        paths[key] = paths.get(key, 0) + 1
    return {"requests": len(answers), "answered": len(ok), "failed": [asdict(a) for a in answers if a not in ok][:5],
            "wall_s": wall_s, "completion_tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s else None,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95), "ttft_max_s": max(ttft, default=None),
            "latency_p50_s": pct([a.seconds for a in ok], 0.5), "latency_p95_s": pct([a.seconds for a in ok], 0.95),
            "cache_paths": paths}


# -- documents ---------------------------------------------------------------------------------------
def tokenizer():
    from transformers import AutoTokenizer

    from orchestra.family import load_family

    return AutoTokenizer.from_pretrained(load_family().member("root").path)


def truncate(tok: Any, text: str, tokens: int) -> str:
    ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
    return tok.decode(ids)


QUESTIONS = [
    "What does this licence allow?", "Who holds the copyright?", "What must a redistributor keep?",
    "Is there a patent grant?", "What happens on patent litigation?", "Can I sublicense?", "Is there a warranty?",
    "What is a Contribution?", "What is a Derivative Work?", "What must a NOTICE file contain?",
    "Can I use the trademarks?", "What about liability?", "Can I charge for support?", "What is the Work?",
    "Who is a Contributor?", "What is Source form?", "What is Object form?", "When does the grant end?",
    "Do I have to state changes?", "How do I apply the licence?", "What is 'Legal Entity'?",
    "What does 'You' mean?", "Is the grant revocable?", "Can I add my own terms?", "What is 'Licensor'?",
]


# -- phases ------------------------------------------------------------------------------------------
async def warm(server: Server, models: list[str]) -> None:
    async with client_for(server) as client:
        for model in models:  # load the weights (seconds each) outside any timing
            await ask(client, model, [{"role": "user", "content": "Hello."}], 4)  # a prefill and decode steps


async def headline(server: Server, document: str, source: str, target: str, repeats: int) -> dict[str, Any]:
    """TTFT on `target` of a question over a document cached on `source` (mapped) vs cold on `target`."""
    rows = []
    async with client_for(server) as client:
        for r in range(repeats):
            def conv(tag: str, question: str, r: int = r) -> list[dict]:
                return [{"role": "system", "content": f"Document {r}{tag}. Answer questions about it.\n\n{document}"},
                        {"role": "user", "content": question}]

            cold = await ask(client, target, conv("a", "What is this document about?"), 1)
            on_source = await ask(client, source, conv("b", "What is this document about?"), 1)
            mapped = await ask(client, target, conv("b", "Who wrote it?"), 1)
            exact = await ask(client, source, conv("b", "Who wrote it?"), 1)
            rows.append({"repeat": r, "prompt_tokens": mapped.prompt_tokens,
                         "cold_target_ttft_s": cold.ttft_s, "cold_target_cache": cold.cache,
                         "cold_source_ttft_s": on_source.ttft_s,
                         "mapped_target_ttft_s": mapped.ttft_s, "mapped_target_cache": mapped.cache,
                         "mapped_cached_tokens": mapped.cached_tokens, "mapped_gates": mapped.gates,
                         "exact_source_ttft_s": exact.ttft_s,
                         "ratio": (cold.ttft_s / mapped.ttft_s) if cold.ttft_s and mapped.ttft_s else None})
    ratios = [row["ratio"] for row in rows if row["ratio"]]
    return {"source": source, "target": target, "rows": rows,
            "median_cold_target_ttft_s": statistics.median(r["cold_target_ttft_s"] for r in rows),
            "median_mapped_target_ttft_s": statistics.median(r["mapped_target_ttft_s"] for r in rows),
            "median_exact_source_ttft_s": statistics.median(r["exact_source_ttft_s"] for r in rows),
            "median_ratio": statistics.median(ratios) if ratios else None}


async def load(server: Server, document: str, clients: int, models: list[str], max_tokens: int) -> dict[str, Any]:
    """`clients` conversations at once, two questions each, the first half on models[0], the rest on models[1]."""
    system = {"role": "system", "content": f"Answer questions about this licence.\n\n{document}"}
    turns: list[list[Answer]] = [[], []]

    async def conversation(i: int, client: Any) -> None:
        model = models[0] if i % 2 == 0 else models[1]
        messages = [system, {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (client {i})"}]
        first = await ask(client, model, messages, max_tokens)
        turns[0].append(first)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Say more, briefly."}]
        turns[1].append(await ask(client, model, messages, max_tokens))

    server.reset_peak()
    before = server.rss()
    started = time.perf_counter()
    async with client_for(server) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(clients)))
    wall = time.perf_counter() - started
    everything = turns[0] + turns[1]
    out = summary(everything, wall)
    out.update({"clients": clients, "turns_per_client": 2, "max_tokens": max_tokens, "models": models,
                "first_turn": summary(turns[0], wall), "second_turn": summary(turns[1], wall),
                "by_model": {m: summary([a for a in everything if a.model == m], wall) for m in models},
                "rss_before_bytes": before, "rss_peak_bytes": server.peak_rss, "rss_after_bytes": server.rss(),
                "cache_and_rows_peak_bytes": server.peak_held, "cache_and_rows_at_rss_peak_bytes": server.held_at_peak,
                "rss_idle_models_bytes": server.idle_rss, "rss_idle_kinds": server.idle_kinds, "timeline": list(server.timeline)})
    for part in ("first_turn", "second_turn", *[f"by_model.{m}" for m in models]):
        target = out[part] if "." not in part else out["by_model"][part.split(".", 1)[1]]
        target.pop("failed", None)
    return out


async def throughput(server: Server, document: str, model: str, concurrency: int, requests: int,
                     max_tokens: int) -> dict[str, Any]:
    """Closed loop: `concurrency` clients each send their share of `requests`, one after another."""
    system = {"role": "system", "content": f"Answer questions about this licence.\n\n{document}"}
    answers: list[Answer] = []
    counter = iter(range(requests))

    async def worker(client: Any) -> None:
        for i in counter:
            question = f"{QUESTIONS[i % len(QUESTIONS)]} (request {i}, {concurrency} clients)"
            answers.append(await ask(client, model, [system, {"role": "user", "content": question}], max_tokens))

    async with client_for(server) as client:
        await ask(client, model, [system, {"role": "user", "content": "Warm the document."}], 1)
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    out = summary(answers, wall)
    out.pop("failed", None)
    return {"concurrency": concurrency, **out}


async def abandoned(server: Server, texts: list[str], count: int, concurrency: int, budget_mb: int) -> dict[str, Any]:
    """`count` distinct conversations (a ~250-token message each), one reply token each, never continued."""
    points = []
    start_rss = server.rss()
    start_metrics = server.metrics()
    sem = asyncio.Semaphore(concurrency)
    failures = 0

    async def one(i: int, client: Any) -> None:
        nonlocal failures
        text = texts[i % len(texts)]
        offset = (i * 613) % max(1, len(text) - 1200)
        messages = [{"role": "user", "content": f"Conversation {i}: what is this about?\n\n{text[offset:offset + 1100]}"}]
        async with sem:
            answer = await ask(client, "root" if i % 2 == 0 else "finetuned", messages, 1)
        failures += answer.status != 200 or answer.error is not None

    started = time.perf_counter()
    async with client_for(server) as client:
        step = max(1, count // 4)
        for lo in range(0, count, step):
            await asyncio.gather(*(one(i, client) for i in range(lo, min(count, lo + step))))
            m = server.metrics()
            points.append({"conversations": min(count, lo + step), "rss_bytes": server.rss(),
                           "cache_bytes": metric_sum(m, "orchestra_cache_bytes"),
                           "evictions": metric_sum(m, "orchestra_cache_evictions_total")
                           - metric_sum(start_metrics, "orchestra_cache_evictions_total")})
    end_rss = server.rss()
    return {"conversations": count, "failed": failures, "seconds": time.perf_counter() - started,
            "budget_bytes": budget_mb << 20, "rss_before_bytes": start_rss, "rss_after_bytes": end_rss,
            "rss_growth_bytes": end_rss - start_rss, "rss_peak_bytes": server.peak_rss,
            "cache_bytes_before": metric_sum(start_metrics, "orchestra_cache_bytes"), "points": points,
            "flat_within_budget": end_rss - start_rss <= (budget_mb << 20)}


# -- report ------------------------------------------------------------------------------------------
def mb(n: float | None) -> str:
    return "–" if n is None else f"{n / (1 << 20):,.0f} MiB"


def s(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def markdown(result: dict[str, Any]) -> list[str]:
    m, h, ld = result["machine"], result["headline"], result["load"]
    lines = [
        "# `orchestra serve` under load (bundled SmolLM2 family, CPU)", "",
        f"Command: `{result['command']}`. Machine: {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}. Server: `orchestra serve {' '.join(result['server_args'])}`. "
        f"Load average (1/5/15 min) at start {fmt_load(result['load_average_start'])}, at end "
        f"{fmt_load(result['load_average_end'])}: the machine is shared, so timings carry other jobs' noise.",
        "", "## Headline: a document cached on another member vs a cold prefill", "",
        f"{h['rows'][0]['prompt_tokens']}-token prompt (a ~4k-token slice of the GPL-3 text, held out from "
        f"calibration), 1 completion token; TTFT measured by the client; median of {len(h['rows'])} repeats.", "",
        f"| repeat | cold prefill on {h['target']} s | cached on {h['source']} → {h['target']} s | path | gates | "
        f"cached tokens | ratio | exact hit on {h['source']} s |", "|---|---|---|---|---|---|---|---|",
    ]
    for row in h["rows"]:
        lines.append(f"| {row['repeat']} | {s(row['cold_target_ttft_s'])} | {s(row['mapped_target_ttft_s'])} | "
                     f"{row['mapped_target_cache']} | {row['mapped_gates'] or '–'} | {row['mapped_cached_tokens']} | "
                     f"{s(row['ratio'], 1)}× | {s(row['exact_source_ttft_s'])} |")
    lines += ["", f"**TTFT ratio (cold / mapped), median: {s(h['median_ratio'], 1)}×** "
              f"({s(h['median_cold_target_ttft_s'])} s → {s(h['median_mapped_target_ttft_s'])} s).", "",
              f"## Load: {ld['clients']} concurrent conversations over one {ld['document_tokens']}-token document", "",
              f"Half on {ld['models'][0]}, half on {ld['models'][1]}, all starting at once on a cold cache; two "
              f"questions each ({ld['requests']} requests, max_tokens {ld['max_tokens']}, greedy, streamed).", "",
              "| | requests | answered | TTFT p50 s | TTFT p95 s | latency p50 s | latency p95 s | tokens/s |",
              "|---|---|---|---|---|---|---|---|"]
    parts = [("all", ld), ("first question", ld["first_turn"]), ("second question", ld["second_turn"]),
             *[(f"on {k}", v) for k, v in ld["by_model"].items()]]
    for name, part in parts:
        lines.append(f"| {name} | {part['requests']} | {part['answered']} | {s(part['ttft_p50_s'])} | "
                     f"{s(part['ttft_p95_s'])} | {s(part['latency_p50_s'])} | {s(part['latency_p95_s'])} | "
                     f"{s(part['tokens_per_s'])} |")
    lines += ["", f"Wall time {s(ld['wall_s'], 1)} s. Cache paths: "
              + ", ".join(f"{k} {v}" for k, v in sorted(ld["cache_paths"].items()))
              + f". Server RSS: {mb(ld['rss_before_bytes'])} before, peak {mb(ld['rss_peak_bytes'])}, "
              f"{mb(ld['rss_after_bytes'])} after."
              + (f" At the peak the cache and the decoding rows held {mb(ld['cache_and_rows_at_rss_peak_bytes'])} "
                 f"(at most {mb(ld['cache_and_rows_peak_bytes'])}; budget {mb(result['cache_mb'] << 20)}); the server "
                 f"with its models loaded and warm, before any document: {mb(ld['rss_idle_models_bytes'])}, so the "
                 f"peak is {mb(ld['rss_peak_bytes'] - ld['rss_idle_models_bytes'] - (result['cache_mb'] << 20))} "
                 "above models + budget." if "rss_idle_models_bytes" in ld else ""), ""]
    lines += ["## Throughput: 1 vs 8 concurrent clients (closed loop, cached document)", "",
              "| decoding | clients | requests | tokens | wall s | tokens/s | TTFT p50 s | latency p50 s |",
              "|---|---|---|---|---|---|---|---|"]
    for mode, runs in result["throughput"].items():
        for run in runs:
            lines.append(f"| {mode} | {run['concurrency']} | {run['answered']}/{run['requests']} | "
                         f"{run['completion_tokens']} | {s(run['wall_s'], 1)} | {s(run['tokens_per_s'])} | "
                         f"{s(run['ttft_p50_s'])} | {s(run['latency_p50_s'])} |")
    gains = result.get("throughput_gain", {})
    if gains:
        lines += ["", "8 vs 1 client tokens/s: " + ", ".join(f"{k} {s(v)}×" for k, v in gains.items()) + "."]
    ab = result["abandoned"]
    lines += ["", f"## Memory: {ab['conversations']} abandoned conversations (--cache-mb {ab['budget_bytes'] >> 20})", "",
              "| conversations | server RSS | cache bytes | evictions |", "|---|---|---|---|",
              f"| 0 | {mb(ab['rss_before_bytes'])} | {mb(ab['cache_bytes_before'])} | 0 |"]
    for point in ab["points"]:
        lines.append(f"| {point['conversations']} | {mb(point['rss_bytes'])} | {mb(point['cache_bytes'])} | "
                     f"{point['evictions']:.0f} |")
    rss = [point["rss_bytes"] for point in ab["points"]]
    lines += ["", f"Over the {ab['conversations']} conversations, after the first checkpoint, server RSS stayed within "
              f"{mb(max(rss) - min(rss))} ({mb(min(rss))} to {mb(max(rss))}; budget {mb(ab['budget_bytes'])}); from "
              f"before the first to after the last: {mb(ab['rss_growth_bytes'])} (the server trims freed memory when "
              f"idle, so the first row can still hold the load phase's). Failed: {ab['failed']}. Peak server RSS over "
              f"the whole run: {mb(result['peak_rss_bytes'])}.", ""]
    return lines


def main() -> None:
    from mappings.atomic import write_atomic
    from orchestra.bench import machine_info
    from orchestra.family.corpus import data_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--abandoned", type=int, default=200)
    parser.add_argument("--cache-mb", type=int, default=1024)
    parser.add_argument("--repair-ladder", default="",
                        help="the server's --repair-ladder, e.g. 0.02,0.05,0.1,0.2 (default: pure maps; a map the probe "
                             "gate refuses is re-prefilled)")
    parser.add_argument("--repeats", type=int, default=3, help="headline repeats")
    parser.add_argument("--max-tokens", type=int, default=8, help="completion tokens in the load phase")
    parser.add_argument("--throughput-tokens", type=int, default=32)
    parser.add_argument("--throughput-requests", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 clients, 16 abandoned, 1 repeat")
    parser.add_argument("--load-only", action="store_true",
                        help="the headline then the load phase only; their JSON in results/serve_load_after_headline.json "
                             "(a memory check, no Markdown report)")
    parser.add_argument("--skip-headline", action="store_true",
                        help="with --load-only: the load phase alone on a fresh server (its peak RSS is the load's own)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--report-only", type=Path, help="rewrite the Markdown from an existing serve_load.json")
    args = parser.parse_args()
    if args.report_only:
        result = json.loads(args.report_only.read_text())
        lines = markdown(result)
        lines.append(f"8 clients, batched vs `--no-batch`: {s(result['batched_vs_unbatched_8_clients'])}× the tokens/s.")
        write_atomic(args.report_only.with_suffix(".md"), "\n".join(lines) + "\n")
        return
    if args.quick:
        args.clients, args.abandoned, args.repeats, args.throughput_requests = 6, 16, 1, 4

    tok = tokenizer()
    document = data_text("apache-2.0.txt")
    long_document = truncate(tok, data_text("gpl-3.txt"), 4000)
    texts = [data_text(name) for name in ("mpl-2.0.txt", "gfdl-1.3.txt", "gpl-3.txt", "apache-2.0.txt")]
    args.out.mkdir(parents=True, exist_ok=True)
    server_args = ["--cache-mb", str(args.cache_mb), "--max-concurrent", "16", "--max-batch", "8",
                   "--max-queue", "1024", "--request-timeout", "3600", "--max-tokens-limit", "256"]
    if args.repair_ladder:
        server_args += ["--repair-ladder", args.repair_ladder]
    result: dict[str, Any] = {"command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
                              "cache_mb": args.cache_mb,
                              "machine": machine_info("cpu").model_dump(), "server_args": server_args,
                              "throughput": {}, "throughput_gain": {}, "load_average_start": os.getloadavg()}

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    logs = Path(tempfile.mkdtemp(prefix="serve_load_"))
    server = Server(logs / "server.log", *server_args)
    try:
        asyncio.run(warm(server, ["root", "finetuned"]))
        server.idle_rss, server.idle_kinds = server.rss(), server.rss_kinds()
        if args.load_only and args.skip_headline:
            result["headline"] = None
        else:
            log(f"server ready, RSS {mb(server.rss())}; headline")
            result["headline"] = asyncio.run(headline(server, long_document, "root", "finetuned", args.repeats))
            log(f"headline ratio {result['headline']['median_ratio']}; load")
        result["load"] = asyncio.run(load(server, document, args.clients, ["root", "finetuned"], args.max_tokens))
        result["load"]["document_tokens"] = len(tok(document, add_special_tokens=False)["input_ids"])
        log(f"load: {result['load']['answered']}/{result['load']['requests']} answered; throughput (batched)")
        if args.load_only:
            kept = {k: result[k] for k in ("command", "cache_mb", "machine", "server_args", "headline", "load")}
            name = "serve_load_only.json" if args.skip_headline else "serve_load_after_headline.json"
            write_atomic(args.out / name, json.dumps(kept, indent=2, default=str))
            print(json.dumps(kept, indent=2, default=str))
            return
        result["throughput"]["batched"] = [
            asyncio.run(throughput(server, document, "root", c, n, args.throughput_tokens))
            for c, n in ((1, max(2, args.throughput_requests // 4)), (8, args.throughput_requests))]
        log("abandoned conversations")
        result["abandoned"] = asyncio.run(abandoned(server, texts, args.abandoned, 4, args.cache_mb))
        result["server_metrics"] = {k: v for k, v in server.metrics().items()
                                    if k.startswith(("orchestra_cache", "orchestra_gate", "orchestra_prefill",
                                                     "orchestra_tokens", "orchestra_rejected"))}
        result["peak_rss_bytes"] = server.peak_rss
    finally:
        result["exit_code"] = server.stop()
    log("throughput (--no-batch)")
    plain = Server(logs / "server_nobatch.log", *server_args, "--no-batch")
    try:
        asyncio.run(warm(plain, ["root"]))
        result["throughput"]["unbatched"] = [
            asyncio.run(throughput(plain, document, "root", c, n, args.throughput_tokens))
            for c, n in ((1, max(2, args.throughput_requests // 4)), (8, args.throughput_requests))]
    finally:
        plain.stop()
    for mode, runs in result["throughput"].items():
        one, eight = runs[0]["tokens_per_s"], runs[1]["tokens_per_s"]
        result["throughput_gain"][mode] = eight / one if one else None
    batched8, plain8 = result["throughput"]["batched"][1]["tokens_per_s"], result["throughput"]["unbatched"][1]["tokens_per_s"]
    result["batched_vs_unbatched_8_clients"] = batched8 / plain8 if plain8 else None

    result["load_average_end"] = os.getloadavg()
    write_atomic(args.out / "serve_load.json", json.dumps(result, indent=2, default=str))
    lines = markdown(result)
    lines.append(f"8 clients, batched vs `--no-batch`: {s(result['batched_vs_unbatched_8_clients'])}× the tokens/s.")
    write_atomic(args.out / "serve_load.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
