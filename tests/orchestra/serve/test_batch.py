"""Step-level batching on a tiny family: concurrent greedy requests decode together and get exactly their solo replies."""

from __future__ import annotations

import anyio
import pytest

from orchestra.serve import ChatCompletionRequest
from tests.orchestra.serve.conftest import tiny_engine

# prompts of different lengths (so rows are left-padded differently), on both members
PROMPTS = [
    ("root", "The committee reviewed the annual report."),
    ("root", "Costs fell as the new plant came online, and the board approved a dividend. Revenue grew."),
    ("finetuned", "def parse(line):"),
    ("root", "Revenue"),
    ("finetuned", "Python functions return values; lists hold items in order and dictionaries map keys."),
    ("root", "The board approved"),
    ("finetuned", "lists hold"),
    ("root", "The committee reviewed the annual report and found that revenue grew in every region."),
]


def request(model: str, text: str, max_tokens: int = 24, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                 temperature=0, **extra)


async def replies(engine, requests: list[ChatCompletionRequest]) -> list[tuple[str, list[int], str]]:
    out: list[tuple[str, list[int], str] | None] = [None] * len(requests)

    async def one(i: int) -> None:
        async with engine.open(requests[i]) as gen:
            text = await gen.text()
        assert gen.result is not None
        out[i] = (text, list(gen.result.token_ids), gen.finish_reason)

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return out  # type: ignore[return-value]


@pytest.fixture(scope="module")
def solo(tiny_serve_family):
    engine = tiny_engine(tiny_serve_family, batch_decode=False, max_concurrent=8)
    return anyio.run(replies, engine, [request(m, t) for m, t in PROMPTS])


async def test_concurrent_greedy_requests_batch_and_match_their_solo_replies(tiny_serve_family, solo):
    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8, max_batch=8)
    batched = await replies(engine, [request(m, t) for m, t in PROMPTS])
    assert batched == solo
    assert all(len(ids) > 0 for _, ids, _ in batched)
    for member in ("root", "finetuned"):
        decoder = engine._batchers[member]
        assert decoder.steps > 0
        assert decoder.rows_stepped / decoder.steps > 1.0, f"{member} never decoded two rows in one step"
    engine.close()


async def test_a_row_leaving_early_leaves_the_others_exact(tiny_serve_family, solo):
    """Rows of different max_tokens and stop strings leave at different steps; the rest carry on unchanged."""
    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8, max_batch=3)
    lengths = [24, 3, 24, 1, 24, 7, 24, 24]
    batched = await replies(engine, [request(m, t, n) for (m, t), n in zip(PROMPTS, lengths, strict=True)])
    for (text, ids, _), (solo_text, solo_ids, _), n in zip(batched, solo, lengths, strict=True):
        assert ids == solo_ids[:n]
        assert solo_text.startswith(text) or n < 24
    engine.close()


async def test_a_cancelled_row_stops_and_frees_its_place(tiny_serve_family, solo):
    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8)
    results: dict[str, list[int]] = {}

    async def cancelled() -> None:
        async with engine.open(request("root", PROMPTS[0][1], max_tokens=200)) as gen:
            async for _ in gen.stream():
                if gen.completion_tokens >= 2:
                    gen.cancel.set()
        results["cancelled"] = list(gen.result.token_ids)

    async def normal() -> None:
        async with engine.open(request(*PROMPTS[1])) as gen:
            await gen.text()
        results["normal"] = list(gen.result.token_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled)
        tg.start_soon(normal)
    assert len(results["cancelled"]) <= 4
    assert results["normal"] == solo[1][1]
    engine.close()


async def test_concurrent_questions_about_one_system_document_prefill_it_once(tiny_serve_family):
    from tests.orchestra.familycache.test_core import TokenCounter

    engine = tiny_engine(tiny_serve_family, max_concurrent=8)
    document = "The committee reviewed the annual report and found that revenue grew in every region. " * 4
    system = {"role": "system", "content": document}
    doc_tokens = len(await engine.prompt_ids("root", [ChatCompletionRequest(model="root", messages=[system]).messages[0]],
                                             add_generation_prompt=False))
    requests = [ChatCompletionRequest(model="root", max_tokens=2, temperature=0,
                                      messages=[system, {"role": "user", "content": f"Question {i}: what grew?"}])
                for i in range(6)]
    cached = [len(await engine.prompt_ids("root", r.messages)) - 1 for r in requests]  # each prompt's cache
    counter = TokenCounter(tiny_serve_family.registry.load("root").model)
    reused = [0] * len(requests)
    leased = [0] * len(requests)

    async def one(i: int) -> None:
        async with engine.open(requests[i]) as gen:
            await gen.text()
        reused[i], leased[i] = gen.cache_info.cached_tokens, gen.leased_tokens

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    finally:
        counter.remove()
    assert doc_tokens >= 64
    prefilled = sum(n for n in counter.tokens if n > 1)  # decoding feeds one token per row
    # One pass read the document; every other request reused at least the document (a later one may reuse
    # more: "Question " of an earlier question's cache, depending on arrival), and each computed exactly
    # what it did not reuse: its lease's rest, then (decoding) the prompt's rest, which for all but the first
    # is its question, computed inline, so those requests store nothing: the pool holds one entry.
    assert sum(1 for n in counter.tokens if n >= doc_tokens) == 1, counter.tokens
    assert sorted(reused)[0] == 0 and min(sorted(reused)[1:]) >= doc_tokens, reused
    first = reused.index(0)
    assert leased[first] == cached[first] and all(leased[i] < cached[i] for i in range(6) if i != first), leased
    inline = sum(c + 1 - n for c, n in zip(cached, leased, strict=True) if c + 1 - n > 1)
    assert prefilled == sum(n - r for n, r in zip(leased, reused, strict=True)) + inline, (prefilled, leased, reused)
    assert len(engine.cache.pool) == 1
    assert prefilled <= doc_tokens + sum(n - doc_tokens for n in cached), (prefilled, doc_tokens, cached)
    assert prefilled < sum(cached) / 2
    engine.close()


async def test_rows_wait_for_room_in_the_cache_budget_and_still_get_their_solo_replies(tiny_serve_family, solo,
                                                                                          monkeypatch):
    """Decoding rows hold their K/V against the cache budget: with no room, one row decodes at a time, on either
    member (a row over the budget is counted, so the other member's rows wait for it)."""
    from orchestra.serve._batch import BatchDecoder

    decoding: set[int] = set()
    most = [0]
    merge, finish = BatchDecoder._merge, BatchDecoder._finish

    def merged(self, job, cache):
        decoding.add(id(job))
        most[0] = max(most[0], len(decoding))
        return merge(self, job, cache)

    def finished(self, job, **kwargs):
        decoding.discard(id(job))
        return finish(self, job, **kwargs)

    monkeypatch.setattr(BatchDecoder, "_merge", merged)
    monkeypatch.setattr(BatchDecoder, "_finish", finished)
    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8, max_batch=8)
    engine.cache.pool.budget_bytes = 1  # no row fits: one at a time, admitted only when nothing else holds budget
    batched = await replies(engine, [request(m, t) for m, t in PROMPTS])
    assert batched == solo
    assert most[0] == 1, "rows of both members decoded over the budget at once"
    for member in ("root", "finetuned"):
        decoder = engine._batchers[member]
        assert decoder.steps > 0 and decoder.rows_stepped == decoder.steps, "two rows decoded over the budget"
        assert decoder.over_budget_rows == sum(1 for m, _ in PROMPTS if m == member)
    assert engine.cache.pool.reserved_bytes == 0 and engine.cache.pool.stats.reservations_refused > 0
    engine.close()


async def test_rows_within_the_budget_hold_it_while_decoding_and_give_it_back(tiny_serve_family, solo):
    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8, max_batch=8)
    held: list[int] = []
    pool = engine.cache.pool
    reserve = pool.reserve

    def watching(nbytes: int) -> bool:
        ok = reserve(nbytes)
        held.append(pool.reserved_bytes)
        return ok

    pool.reserve = watching  # type: ignore[method-assign]
    batched = await replies(engine, [request(m, t) for m, t in PROMPTS])
    assert batched == solo
    assert max(held) > 0 and pool.reserved_bytes == 0
    assert all(engine._batchers[m].over_budget_rows == 0 for m in ("root", "finetuned"))
    engine.close()


async def test_a_joining_row_holds_its_tail_pass_memory_until_it_is_in_the_batch(tiny_serve_family, solo, monkeypatch):
    """A row's join (its prompt tail's forward pass, the copy into the batch) needs memory beside its K/V: held
    from admission until the row has merged, then given back, so decoding holds only the K/V and one layer."""
    from orchestra.serve._batch import BatchDecoder

    engine = tiny_engine(tiny_serve_family, batch_decode=True, max_concurrent=8, max_batch=8)
    pool = engine.cache.pool
    before: list[tuple[int, int]] = []
    after: list[tuple[int, int, int]] = []
    join, joined = BatchDecoder._join, BatchDecoder._joined

    def joining(self, job):
        before.append((job.reserved, job.joining))
        return join(self, job)

    def merged(self, job):
        # the row's own share, not the pool's total: other rows are admitted and reserve meanwhile
        held, share = job.reserved, job.joining
        joined(self, job)
        after.append((job.reserved, job.joining, held - job.reserved if held - job.reserved == share else -1))

    monkeypatch.setattr(BatchDecoder, "_join", joining)
    monkeypatch.setattr(BatchDecoder, "_joined", merged)
    batched = await replies(engine, [request(m, t) for m, t in PROMPTS])
    assert batched == solo
    assert before and all(j > 0 and r > j for r, j in before), "a joining row holds its K/V and its join's memory"
    assert after and all(j == 0 and freed > 0 for _, j, freed in after), "a merged row gave its join's memory back"
    assert pool.reserved_bytes == 0
    engine.close()


def test_a_rows_join_memory_grows_with_its_tail_and_with_the_batch(tiny_serve_family):
    """The join's share covers the tail's pass (more new tokens, more memory) or the batch layer the row is
    copied into (more rows, a wider copy), whichever is larger; the K/V share does not depend on either."""
    import threading

    from orchestra.serve._batch import BatchDecoder, _Job

    engine = tiny_engine(tiny_serve_family, batch_decode=True)
    decoder = BatchDecoder(engine.cache.executor.model("root"), threading.Lock())

    def job(tail: int) -> _Job:
        return _Job(None, 200, list(range(tail)), stream=None, cancel=threading.Event())  # type: ignore[arg-type]

    short, long = decoder.row_memory(job(4), 1), decoder.row_memory(job(120), 1)
    assert long.join > short.join and long.kv > short.kv
    alone, crowded = decoder.row_memory(job(4), 1), decoder.row_memory(job(4), 64)
    assert crowded.kv == alone.kv and crowded.join > alone.join
    engine.close()
