"""Task level: do built-in agents say the same thing on a mapped cache as on the target's own prefill?

For each pair, the document prefix is prefilled on the target (the truth) and, separately, on the
source and mapped into the target the way the scheduler does it (the mapping's own method, then
the last ``tail_tokens`` recomputed on the target). Each agent then runs greedily on both caches;
summaries are compared with ROUGE-L (F1 of the longest common token subsequence), extracted
facts by exact match, and both by how many generated tokens agree before the first difference.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily, Pair

__all__ = ["TaskConfig", "TaskRow", "TaskSection", "run_tasks", "rouge_l", "lcs_length", "TASK_AGENTS"]

TASK_AGENTS = ("summarizer", "key_facts")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskConfig(_Model):
    pairs: list[Pair]
    document_tokens: int = Field(1024, ge=16, description="held-out document tokens the agents read")
    max_new_tokens: int = Field(48, ge=1, description="tokens each agent may generate")
    tail_tokens: int = Field(32, ge=0, description="prefix tokens recomputed on the target after mapping")
    agents: list[str] = Field(default_factory=lambda: list(TASK_AGENTS))


class TaskRow(_Model):
    pair: str
    agent: str
    metric: str = Field(description="rouge_l (summaries), exact_match (parsed facts) or exact_match_raw (raw replies, "
                        "when either side's JSON did not validate)")
    score: float | None = Field(description="agreement of the mapped run with the re-prefilled run (1 = identical)")
    token_agreement: int = Field(description="generated tokens identical before the first difference")
    tokens_truth: int
    tokens_mapped: int
    truth: str
    mapped: str
    truth_error: str | None = None
    mapped_error: str | None = None


class TaskSection(_Model):
    config: TaskConfig
    document_tokens: int = Field(description="prefix tokens (preamble + document) the agents ran on")
    rows: list[TaskRow] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


def _words(text: str) -> list[str]:
    return text.lower().split()


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (O(len(a)·len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (1.0 for two empty texts)."""
    ref, cand = _words(reference), _words(candidate)
    if not ref and not cand:
        return 1.0
    lcs = lcs_length(ref, cand)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(cand), lcs / len(ref)
    return 2 * p * r / (p + r)


def _facts(parsed: Any) -> list[str] | None:
    if parsed is None:
        return None
    facts = getattr(parsed, "facts", None)
    if facts is None and isinstance(parsed, dict):
        facts = parsed.get("facts")
    return [" ".join(str(f).split()) for f in facts] if facts is not None else None


def _spec(agent: str, max_new_tokens: int):
    from agents import builtin

    if agent == "summarizer":
        return builtin.summarizer(max_words=60, max_new_tokens=max_new_tokens)
    if agent == "key_facts":
        # no repairs: a repair turn would compare two different prompts
        return builtin.key_facts(max_facts=4, max_new_tokens=max_new_tokens, max_repairs=0)
    factory = builtin.BUILTINS.get(agent)
    if factory is None:
        raise ValueError(f"unknown agent {agent!r}; use one of {', '.join(builtin.BUILTINS)}")
    return factory(max_new_tokens=max_new_tokens)


def _run(model: Any, tokenizer: Any, spec: Any, prefix_ids: list[int], cache: Any) -> tuple[Any, str | None]:
    from agents import generate
    from agents.errors import AgentError

    try:
        return generate(model, tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=cache), None
    except AgentError as exc:  # e.g. invalid JSON from a small model: recorded, not fatal
        return exc, f"{type(exc).__name__}: {exc}"


def _output(result: Any, tokenizer: Any) -> tuple[str, list[int]]:
    """Text and generated ids of a result, or of the raw reply an output error carries."""
    if hasattr(result, "token_ids"):
        return result.text, list(result.token_ids)
    raw = getattr(result, "raw_output", "") or ""
    return raw, list(tokenizer(raw, add_special_tokens=False)["input_ids"]) if raw else []


def _first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_tasks(config: TaskConfig, fam: BenchFamily, *, progress: bool = True) -> TaskSection:
    from tqdm.auto import tqdm

    from agents import DocumentPrompt, suffix_ids

    text = fam.text(config.document_tokens)
    section = TaskSection(config=config, document_tokens=0)
    bar = tqdm(config.pairs, desc="tasks", disable=not progress)
    for pair in bar:
        bar.set_postfix_str(pair.label)
        target = fam.loaded(pair.target)
        prefix = DocumentPrompt(text).token_ids(target.tokenizer)
        section.document_tokens = len(prefix)
        limit = fam.max_positions(pair.target)
        fam.mapping(pair)  # calibrated into the store first when missing
        cache = fam.family_cache(pair.source, tail_tokens=max(2, min(config.tail_tokens, len(prefix) - 1)))
        truth_lease = cache.acquire_sync(pair.target, prefix, allow_mapped=False, reuse=False)
        cache.acquire_sync(pair.source, prefix).release()
        mapped_lease = cache.acquire_sync(pair.target, prefix)
        if mapped_lease.path != "mapped":
            section.skipped.append(f"{pair.label}: no mapped cache ({mapped_lease.fallback_reason})")
            continue
        truth_cache, mapped_cache = truth_lease.cache, mapped_lease.cache
        for agent in config.agents:
            spec = _spec(agent, config.max_new_tokens)
            need = len(prefix) + len(suffix_ids(target.tokenizer, spec)) + config.max_new_tokens
            if limit is not None and need > limit:
                section.skipped.append(f"{pair.label} {agent}: prompt + {config.max_new_tokens} new tokens need {need} "
                                       f"positions, the target has {limit}")
                continue
            truth, t_err = _run(target.model, target.tokenizer, spec, prefix, truth_cache)
            got, m_err = _run(target.model, target.tokenizer, spec, prefix, mapped_cache)
            t_text, t_ids = _output(truth, target.tokenizer)
            m_text, m_ids = _output(got, target.tokenizer)
            if spec.output is not None and spec.output.kind == "json":
                tf = _facts(getattr(truth, "parsed", None))
                mf = _facts(getattr(got, "parsed", None))
                # both parsed: compare the facts; otherwise the raw replies (a small model's JSON can fail on both)
                metric, score = ("exact_match", float(tf == mf)) if tf is not None and mf is not None else (
                    "exact_match_raw", float(t_text == m_text))
            else:
                metric, score = "rouge_l", rouge_l(t_text, m_text)
            section.rows.append(TaskRow(
                pair=pair.label, agent=agent, metric=metric, score=score,
                token_agreement=_first_divergence(t_ids, m_ids), tokens_truth=len(t_ids), tokens_mapped=len(m_ids),
                truth=t_text, mapped=m_text, truth_error=t_err, mapped_error=m_err,
            ))
    return section
