"""Task level: do members answer questions about a document as well on a mapped cache as on their own prefill?

The QA set (:mod:`orchestra.bench.qa`) asks extractive questions over windows of the bundled
licenses. For every window, the ``question_answerer`` built-in answers each of its questions
greedily on four caches, all from one :class:`orchestra.familycache.FamilyCache`:

- ``source``: the source member (the root) on its own prefill, which every map starts from;
- ``own``: each other member on its own prefill (``allow_mapped=False``);
- ``mapped``: the source's cache mapped into the member, gates open (the pure map + the cache's
  recomputed tail: what an agent runs on when the gates pass);
- ``mapped+repair``: the same map, repaired as the built-in asks (its ``mapped_repair``: what a pipeline
  runs it with), or at ``repair_budget`` of a prefill when that is given;
- ``plain``: the baseline a user would try first, no orchestra prompt at all: the member's chat template
  over one user turn holding the window and then the question, on its own prefill, greedy, with the same
  token budget and stop strings (``plain_prompt_ids``). The built-in must be at least as accurate as it.

Accuracy is normalised containment of a reference answer (:func:`orchestra.bench.qa.is_correct`);
retention = accuracy on the mapped (or repaired) cache / accuracy on the member's own prefill. The
member's default gates (``gate``) are also asked about the same map, to report how many windows
would have fallen back to a re-prefill. Optionally (``lengths``) the source's own-prefill accuracy
is measured at several window lengths, to size a demo to what the model can answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from agents.agreement import token_f1
from orchestra.bench._context import BenchFamily, Pair
from orchestra.bench.gate_signals import GateCandidate, Judged, score_candidates
from orchestra.familycache.gates import GatePolicy

if TYPE_CHECKING:
    from agents.spec import AgentSpec
    from mappings.repair import RepairPolicy
    from mappings.types import Tensor, Tokenizer
    from orchestra.bench.qa import QAQuestion, QASet
    from orchestra.familycache import CacheLease, FamilyCache

__all__ = ["TaskConfig", "QAAnswer", "QAScore", "GateSummary", "LengthRow", "TaskSection", "run_tasks",
           "score_answers", "tasks_markdown", "rouge_l", "lcs_length", "CONDITIONS", "plain_prompt_ids", "judged_answers", "token_f1"]

Condition = Literal["source", "own", "mapped", "mapped+repair", "plain"]
CONDITIONS: tuple[Condition, ...] = ("own", "mapped", "mapped+repair", "source", "plain")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskConfig(_Model):
    source: str = Field(description="the member whose prefill is mapped into the others (and answers itself)")
    members: list[str] = Field(description="members the source's cache is mapped into")
    window_tokens: int = Field(512, ge=16, description="document tokens around each passage (never fewer than it has)")
    max_new_tokens: int = Field(24, ge=1, description="tokens each answer may generate (greedy)")
    tail_tokens: int = Field(32, ge=2, description="prefix tokens the FamilyCache recomputes on the target after a map")
    repair_budget: float | None = Field(None, gt=0.0, le=1.0, description="repair budget of the mapped+repair "
                                        "condition (None: the built-in's own `mapped_repair`)")
    repair_focus: Literal["tail", "question"] = Field(
        "tail", description="what ranks the interior tokens the repair recomputes: the document's last tokens, or "
        "each question (`RepairPolicy.focus`: a repaired cache per question, all of the budget after the sinks on "
        "what the question reads when `repair_budget` is given)")
    repair_costs: Literal["measured", "compute"] = Field(
        "measured", description="how that budget is priced: the target's timed passes, or multiply-adds")
    stop: list[str] = Field(default_factory=lambda: ["\n\n", "Question:"],
                            description="stop strings: the answer is one reply, not the next question a small model "
                                        "goes on to invent")
    gate: GatePolicy = Field(default_factory=GatePolicy, description="the gates whose decision on the map is reported")
    questions: list[str] | None = Field(None, description="question ids to ask (default: all)")
    limit: int | None = Field(None, ge=1, description="ask only the first N (selected) questions")
    lengths: list[int] = Field(default_factory=list, description="window lengths of the source's accuracy sweep")
    qa_file: str | None = Field(None, description="a QA set other than the bundled one")
    plain: bool = Field(True, description="also answer with a plain chat prompt (document then question in one user "
                                          "turn), the baseline the built-in must match")

    def repair_policy(self) -> RepairPolicy:
        """The mapped+repair condition's repair: `repair_budget` of a prefill, else the question answerer's own."""
        from agents.builtin import QA_REPAIR
        from mappings.repair import RepairPolicy

        if self.repair_budget is None:
            return QA_REPAIR
        return RepairPolicy(budget=self.repair_budget, scattered_share=1.0 if self.repair_focus == "question" else 0.0)


class QAAnswer(_Model):
    """One question answered by one member on one cache."""

    question: str
    member: str
    condition: Condition
    window_tokens: int = Field(description="document tokens in the window")
    prefix_tokens: int = Field(description="prompt prefix tokens (preamble + window) the cache holds")
    path: str = Field(description="the FamilyCache lease's path: exact, mapped or reprefilled")
    prediction: str
    correct: bool
    error: str | None = None
    signals: dict[str, float] = Field(default_factory=dict, description="on the pure map: what each candidate gate "
                                      "read (`orchestra.bench.gate_signals`; larger is worse)")


class QAScore(_Model):
    member: str
    condition: Condition
    n: int
    correct: int
    accuracy: float
    retention: float | None = Field(None, description="accuracy / the member's own-prefill accuracy (None if that is 0)")
    agreement: float | None = Field(None, description="share of answers equal (normalised) to the own-prefill answer")
    agreement_f1: float | None = Field(None, description="mean token F1 of the answers against the own-prefill answers")
    retention_interval: tuple[float, float] | None = Field(
        None, description="95 % paired bootstrap interval of the retention, over the questions")
    agreement_interval: tuple[float, float] | None = Field(None, description="95 % Wilson interval of the agreement")
    lost: int | None = Field(None, description="questions the own prefill answers right and this cache wrong")
    gained: int | None = Field(None, description="questions the own prefill answers wrong and this cache right")
    rouge_l: float | None = Field(None, description="mean ROUGE-L of the answers against the own-prefill answers")
    paths: dict[str, int] = Field(default_factory=dict, description="lease paths the answers ran on")


class GateSummary(_Model):
    """What the member's gates decided about the pure map, window by window."""

    member: str
    windows: int
    passed: int
    fell_back: int = Field(description="windows that would have been re-prefilled instead of mapped")
    failed_gates: dict[str, int] = Field(default_factory=dict, description="first failing gate -> windows")
    reasons: list[str] = Field(default_factory=list, description="distinct fallback reasons (first few)")
    harmed: int = Field(0, description="windows where the pure map turned an answer the own prefill got right wrong")
    changed: int = Field(0, description="windows where some answer on the pure map differs from the own-prefill one")
    catch_rate: float | None = Field(None, description="harmed windows the gates refused / harmed windows")
    false_alarm_rate: float | None = Field(None, description="unharmed windows the gates refused / unharmed windows")
    changed_catch_rate: float | None = Field(None, description="changed windows the gates refused / changed windows")
    catch_interval: tuple[float, float] | None = Field(None, description="95 % Wilson interval of the catch rate")
    false_alarm_interval: tuple[float, float] | None = Field(
        None, description="95 % Wilson interval of the false-alarm rate")
    candidates: list[GateCandidate] = Field(default_factory=list, description="each candidate reading scored as a "
                                            "gate over the member's questions")


class LengthRow(_Model):
    """The source's own-prefill accuracy at one window length."""

    length: int
    member: str
    n: int
    correct: int
    accuracy: float
    mean_window_tokens: float
    mean_prefix_tokens: float
    skipped: int = 0
    plain_accuracy: float | None = Field(None, description="the plain-prompt baseline's accuracy on the same windows")
    by_type: dict[str, float] = Field(default_factory=dict, description="accuracy per answer type")
    correct_ids: list[str] = Field(default_factory=list)


class MappingUsed(_Model):
    """The stored mapping a member's mapped answers ran on: two runs compare only when these agree."""

    method: str
    calibration_tokens: int = Field(description="tokens the map was fitted on")
    window: int = Field(description="tokens per calibration window")
    corpus: list[str] = Field(default_factory=list, description="calibration texts")
    heldout_kl: float | None = Field(None, description="the calibration's held-out next-token KL")
    created_at: str = Field(description="when the mapping was calibrated (UTC, ISO 8601)")


class TaskSection(_Model):
    config: TaskConfig
    dataset: str = Field(description="QA set name and version")
    questions: int
    passages: int
    mean_prefix_tokens: float = 0.0
    repair: dict[str, object] | None = Field(None, description="the mapped+repair condition's repair policy")
    repair_costs: list[float] = Field(default_factory=list, description="its planned cost per window, a share of "
                                      "one target prefill")
    scores: list[QAScore] = Field(default_factory=list)
    gates: list[GateSummary] = Field(default_factory=list)
    lengths: list[LengthRow] = Field(default_factory=list)
    answers: list[QAAnswer] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    mappings: dict[str, MappingUsed] = Field(default_factory=dict, description="member -> the mapping its mapped "
                                             "answers ran on")

    def score(self, member: str, condition: str) -> QAScore:
        for s in self.scores:
            if s.member == member and s.condition == condition:
                return s
        raise KeyError((member, condition))


# -- agreement between two answers (the earlier task metric, kept: it is free) ------------------------
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


# -- running ----------------------------------------------------------------------------------------
class Reply(NamedTuple):
    """One answer as decoded: its text, why it failed (None: it did not) and the generated token ids."""

    text: str
    error: str | None
    token_ids: tuple[int, ...]


class QAAsker:
    """Answers questions with an agent (the question_answerer built-in unless `agent` is given) over a lease's
    cache, or the plain way; memoises answers on exact caches."""

    def __init__(self, fam: BenchFamily, cache: FamilyCache, max_new_tokens: int, stop: list[str],
                 agent: Callable[[str, int], AgentSpec] | None = None) -> None:
        self.fam, self.cache, self.max_new, self.stop = fam, cache, max_new_tokens, tuple(stop)
        self.agent = agent
        """(question, max_new_tokens) -> the agent that answers (None: the question_answerer built-in)."""
        self._memo: dict[tuple[str, tuple[int, ...], str], Reply] = {}

    def spec(self, q: QAQuestion) -> AgentSpec:
        from agents import BUILTINS

        make = self.agent or (lambda question, n: BUILTINS["question_answerer"](question=question, max_new_tokens=n))
        spec = make(q.question, self.max_new)
        if not self.stop:
            return spec
        return spec.model_copy(update={"generation": spec.generation.model_copy(update={"stop": self.stop})})

    def fits(self, member: str, prefix: list[int], questions: list[QAQuestion]) -> str | None:
        """Why the longest prompt would not fit the member, or None."""
        from agents import suffix_ids

        limit = self.fam.max_positions(member)
        if limit is None:
            return None
        tok = self.fam.loaded(member).tokenizer
        need = len(prefix) + max(len(suffix_ids(tok, self.spec(q))) for q in questions) + self.max_new
        return None if need <= limit else f"{need} positions needed, {member} has {limit}"

    def ask_plain(self, member: str, window_text: str, q: QAQuestion) -> tuple[str, str | None]:
        """`q` asked the plain way (`plain_prompt_ids`) on the member's own prefill, greedy, same budget and stops."""
        from agents.continuation import continue_ids
        from agents.errors import AgentError

        lm = self.fam.loaded(member)
        ids = plain_prompt_ids(lm.tokenizer, window_text, q.question)
        try:
            with self.cache.lock(member):
                out = continue_ids(lm.model, lm.tokenizer, None, 0, ids, max_new_tokens=self.max_new, stop=self.stop)
        except AgentError as exc:
            return "", f"{type(exc).__name__}: {exc}"
        return out.text.strip(), None

    def answer_plain(self, member: str, window_text: str, window_tokens: int, qs: list[QAQuestion]) -> list[QAAnswer]:
        """`qs` asked the plain way over `window_text`, scored."""
        from orchestra.bench.qa import is_correct

        out = []
        for q in qs:
            text, err = self.ask_plain(member, window_text, q)
            out.append(QAAnswer(question=q.id, member=member, condition="plain", window_tokens=window_tokens,
                                prefix_tokens=0, path="own", prediction=text,
                                correct=err is None and is_correct(text, q.answers), error=err))
        return out

    def ask(self, member: str, lease: CacheLease, prefix: list[int], q: QAQuestion) -> Reply:
        from agents import generate
        from agents.errors import AgentError

        key = (member, tuple(prefix), q.id)
        if lease.path == "exact" and key in self._memo:  # the same exact cache and prompt: greedy gives the same
            return self._memo[key]
        lm = self.fam.loaded(member)
        try:
            result = generate(lm.model, lm.tokenizer, self.spec(q), prefix_ids=prefix, prefix_cache=lease.local_cache(),
                              lock=self.cache.lock(member))
            out = Reply(result.text.strip(), None, tuple(result.token_ids))
        except AgentError as exc:  # e.g. a context overflow: recorded as a wrong answer, not fatal
            out = Reply("", f"{type(exc).__name__}: {exc}", ())
        if lease.path == "exact":
            self._memo[key] = out
        return out


def plain_prompt_ids(tokenizer: Tokenizer, document: str, question: str) -> list[int]:
    """What a user would send without orchestra: one user turn, the document then the question, in the
    tokenizer's chat template (a ``Question:``/``Answer:`` text when it has none)."""
    from agents.prompt import has_chat_template

    if has_chat_template(tokenizer):
        messages: list[dict[str, str]] = [{"role": "user", "content": f"{document}\n\n{question}"}]
        text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    return [int(i) for i in tokenizer.encode(f"{document}\n\nQuestion: {question}\nAnswer:")]


def score_answers(member: str, condition: Condition, answers: list[QAAnswer],
                  own: dict[str, QAAnswer] | None = None) -> QAScore:
    """The member's accuracy on ``answers``; for a mapped condition also its retention, agreement and the
    questions it lost and gained against ``own`` (question id -> the own-prefill answer), with intervals."""
    from orchestra.bench.intervals import paired_ratio_interval, wilson
    from orchestra.bench.qa import normalize

    n = len(answers)
    correct = sum(a.correct for a in answers)
    score = QAScore(member=member, condition=condition, n=n, correct=correct, accuracy=correct / n if n else 0.0,
                    paths=dict(Counter(a.path for a in answers)))
    if own is not None and condition in ("mapped", "mapped+repair"):
        pairs = [(own[a.question], a) for a in answers if a.question in own]
        if pairs:
            agree = sum(normalize(o.prediction) == normalize(a.prediction) for o, a in pairs)
            score.agreement = agree / len(pairs)
            score.agreement_interval = wilson(agree, len(pairs))
            score.rouge_l = sum(rouge_l(o.prediction, a.prediction) for o, a in pairs) / len(pairs)
            score.agreement_f1 = sum(token_f1(o.prediction, a.prediction) for o, a in pairs) / len(pairs)
            score.lost = sum(o.correct and not a.correct for o, a in pairs)
            score.gained = sum(a.correct and not o.correct for o, a in pairs)
        own_correct = sum(o.correct for o, _ in pairs)
        score.retention = (sum(a.correct for _, a in pairs) / own_correct) if own_correct else None
        score.retention_interval = paired_ratio_interval([o.correct for o, _ in pairs], [a.correct for _, a in pairs])
    return score


def _chosen_questions(qa: QASet, config: TaskConfig) -> list[QAQuestion]:
    """The questions asked: those named (an unknown id is an error), else all; at most ``config.limit``."""
    chosen = [q for q in qa.questions if config.questions is None or q.id in config.questions]
    if config.questions is not None:
        unknown = sorted(set(config.questions) - {q.id for q in qa.questions})
        if unknown:
            raise ValueError(f"unknown question id(s) {', '.join(unknown)}")
    return chosen[: config.limit] if config.limit else chosen


def _mappable_members(fam: BenchFamily, source: str, wanted: list[str], section: TaskSection) -> list[str]:
    """The members other than the source that it maps into (calibrated into the store first when missing),
    each one's mapping recorded in ``section.mappings``; one it cannot map into is reported in
    ``section.skipped`` and the others still run."""
    members: list[str] = []
    for m in dict.fromkeys(wanted):
        if m == source:
            continue
        try:
            manifest = fam.mapping(Pair(source=source, target=m)).manifest
        except Exception as exc:
            section.skipped.append(f"{source}>{m}: no mapping ({type(exc).__name__}: {exc})")
            continue
        cal = manifest.calibration
        section.mappings[m] = MappingUsed(method=manifest.method.name, calibration_tokens=cal.token_count,
                                          window=cal.window, corpus=list(cal.corpus_names),
                                          heldout_kl=manifest.heldout.get("kl"), created_at=manifest.created_at)
        members.append(m)
    return members


@dataclass(frozen=True)
class _GateWindow:
    """The member's gates on one window's pure map, and the questions asked over that window."""

    lease: CacheLease
    questions: tuple[str, ...]


def _gate_summary(member: str, windows: list[_GateWindow], answers: list[QAAnswer]) -> GateSummary:
    """How often the gates passed the member's map, which gate refused it when they did not, and how well their
    refusals match the windows where the pure map changed (or harmed) an answer of the member's own prefill."""
    from orchestra.bench.intervals import wilson
    from orchestra.bench.qa import normalize

    leases = [w.lease for w in windows]
    failed = [next(d.gate for d in lease.gates if not d.passed) if any(not d.passed for d in lease.gates)
              else "other" for lease in leases if lease.path != "mapped"]
    own = {a.question: a for a in answers if a.member == member and a.condition == "own"}
    mapped = {a.question: a for a in answers if a.member == member and a.condition == "mapped"}
    harmed, changed = [], []
    for w in windows:
        pairs = [(own[q], mapped[q]) for q in w.questions if q in own and q in mapped]
        harmed.append(any(o.correct and not m.correct for o, m in pairs))
        changed.append(any(normalize(o.prediction) != normalize(m.prediction) for o, m in pairs))
    refused = [lease.path != "mapped" for lease in leases]

    def share(numerator: list[bool], among: list[bool]) -> tuple[float | None, tuple[float, float] | None]:
        """The share of ``among`` that ``numerator`` holds, and its Wilson interval (None, None: none among)."""
        n = sum(among)
        hits = sum(x and y for x, y in zip(numerator, among, strict=True))
        return (hits / n, wilson(hits, n)) if n else (None, None)

    catch, catch_interval = share(refused, harmed)
    false_alarm, false_alarm_interval = share(refused, [not h for h in harmed])
    return GateSummary(
        member=member, windows=len(leases), passed=sum(lease.path == "mapped" for lease in leases),
        fell_back=sum(refused), failed_gates=dict(Counter(failed)),
        reasons=list(dict.fromkeys(lease.fallback_reason or "" for lease in leases if lease.path != "mapped"))[:3],
        harmed=sum(harmed), changed=sum(changed), catch_rate=catch, false_alarm_rate=false_alarm,
        changed_catch_rate=share(refused, changed)[0], catch_interval=catch_interval,
        false_alarm_interval=false_alarm_interval)


@dataclass(frozen=True)
class _TaskRun:
    """One `run_tasks` call's QA set, members, cache and asker, and the windows it has cut so far."""

    config: TaskConfig
    qa: QASet
    tok: Tokenizer
    members: list[str]
    cache: FamilyCache
    asker: QAAsker
    repair: RepairPolicy
    open_gate: GatePolicy
    offsets: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    texts: dict[tuple[str, int], str] = field(default_factory=dict)

    def window(self, pid: str, tokens: int) -> tuple[list[int], int]:
        """The passage's window of ~`tokens` document tokens: its prompt prefix ids and document tokens."""
        from agents import DocumentPrompt
        from orchestra.bench.qa import passage_window, token_offsets

        p = self.qa.passage(pid)
        doc = self.qa.document_text(p.document)
        if p.document not in self.offsets:
            self.offsets[p.document] = token_offsets(doc, self.tok)
        text, n = passage_window(doc, p.start, p.end, tokens, self.tok, self.offsets[p.document])
        self.texts[(pid, tokens)] = text
        return DocumentPrompt(text).token_ids(self.tok), n

    def answer(self, member: str, condition: Condition, lease: CacheLease, prefix: list[int], n: int,
               qs: list[QAQuestion], token_ids: dict[str, tuple[int, ...]] | None = None) -> list[QAAnswer]:
        """`qs` asked by `member` on the lease's cache, scored; each answer's generated ids go to `token_ids`."""
        from orchestra.bench.qa import is_correct

        out = []
        for q in qs:
            text, err, ids = self.asker.ask(member, lease, prefix, q)
            if token_ids is not None:
                token_ids[q.id] = ids
            out.append(QAAnswer(question=q.id, member=member, condition=condition, window_tokens=n,
                                prefix_tokens=len(prefix), path=lease.path, prediction=text,
                                correct=err is None and is_correct(text, q.answers), error=err))
        return out

    def answer_rows(self, member: str, lease: CacheLease, prefix: list[int], qs: list[QAQuestion],
                    answers: dict[str, tuple[int, ...]] | None = None) -> dict[str, Tensor]:
        """Each question's answer logits on the lease's cache (what the candidate gates read): one row per token
        of its answer in `answers`, else the first answer token's alone."""
        from agents import suffix_ids
        from orchestra.bench.gate_signals import answer_logits

        lm = self.asker.fam.loaded(member)
        with self.cache.lock(member):
            return {q.id: answer_logits(lm.model, lease.local_cache(), len(prefix),
                                        suffix_ids(lm.tokenizer, self.asker.spec(q)), (answers or {}).get(q.id, ()))
                    for q in qs}

    def plain(self, member: str, pid: str, tokens: int, n: int, qs: list[QAQuestion]) -> list[QAAnswer]:
        """`qs` asked the plain way over the text `window` cut for (`pid`, `tokens`)."""
        return self.asker.answer_plain(member, self.texts[(pid, tokens)], n, qs)


@dataclass(frozen=True)
class _Window:
    """One passage's window as asked: its prompt prefix ids, document tokens and questions."""

    prefix: list[int]
    tokens: int
    questions: list[QAQuestion]
    source_starts: dict[str, Tensor]
    """The source's first-answer-token logits per question, on its own cache (one row each)."""


def run_tasks(config: TaskConfig, fam: BenchFamily, *, progress: bool = True) -> TaskSection:
    """Every passage's questions answered under every condition, scored, and the optional length sweep."""
    from tqdm.auto import tqdm

    from orchestra.bench.qa import load_qa

    qa = load_qa(config.qa_file)
    chosen = _chosen_questions(qa, config)
    groups = qa.by_passage(chosen)
    repair = config.repair_policy()
    section = TaskSection(config=config, dataset=f"{qa.name} v{qa.version}", questions=len(chosen),
                          passages=len(groups), repair=repair.model_dump(mode="json"))
    run = _task_run(config, fam, qa, repair, section)
    gate_log: dict[str, list[_GateWindow]] = {m: [] for m in run.members}
    answers: list[QAAnswer] = []
    prefix_lengths: list[int] = []
    bar = tqdm(list(groups.items()), desc="tasks", disable=not progress)
    for pid, qs in bar:
        bar.set_postfix_str(pid)
        asked = _answer_passage(run, pid, qs, section, gate_log)
        if asked is not None:
            answers += asked[0]
            prefix_lengths.append(asked[1])
    section.answers = answers
    section.mean_prefix_tokens = sum(prefix_lengths) / len(prefix_lengths) if prefix_lengths else 0.0
    _fill_scores(section, run.members, gate_log)
    for length in config.lengths:
        section.lengths.append(_length_row(length, config.source, groups, run.window, run.asker, run.cache,
                                           run.answer, progress, run.plain if config.plain else None))
    return section


def _task_run(config: TaskConfig, fam: BenchFamily, qa: QASet, repair: RepairPolicy,
              section: TaskSection) -> _TaskRun:
    """The source's tokenizer, the members it maps into (their mappings recorded in `section`, others noted
    as skipped), cache and asker."""
    tok = fam.loaded(config.source).tokenizer
    members = _mappable_members(fam, config.source, config.members, section)
    # Gates open for the measured conditions: the map itself is what is scored; `config.gate` is asked
    # separately.
    cache = fam.family_cache(config.source, tail_tokens=config.tail_tokens, repair_costs=config.repair_costs)
    open_gate = GatePolicy(offline=None, probe=None)
    asker = QAAsker(fam, cache, config.max_new_tokens, config.stop)
    return _TaskRun(config=config, qa=qa, tok=tok, members=members, cache=cache, asker=asker, repair=repair,
                    open_gate=open_gate)


def _answer_passage(run: _TaskRun, pid: str, qs: list[QAQuestion], section: TaskSection,
                    gate_log: dict[str, list[_GateWindow]]) -> tuple[list[QAAnswer], int] | None:
    """A passage's answers under every condition and its prefix length; None (noted) if a prompt won't fit."""
    config, source = run.config, run.config.source
    prefix, n = run.window(pid, config.window_tokens)
    why = next((w for m in [source, *run.members] if (w := run.asker.fits(m, prefix, qs))), None)
    if why:
        section.skipped.append(f"{pid}: {why}")
        return None
    with run.cache.acquire_sync(source, prefix) as lease:
        answers = run.answer(source, "source", lease, prefix, n, qs)
        window = _Window(prefix=prefix, tokens=n, questions=qs, source_starts=run.answer_rows(source, lease, prefix, qs))
    for m in run.members:
        answers += _member_answers(run, m, window, section.repair_costs, gate_log[m])
    for m in [source, *run.members] if config.plain else []:
        answers += run.plain(m, pid, config.window_tokens, n, qs)
    run.cache.clear()  # windows share nothing: keep memory flat
    return answers, len(prefix)


def _member_answers(run: _TaskRun, member: str, w: _Window, repair_costs: list[float],
                    gate_log: list[_GateWindow]) -> list[QAAnswer]:
    """The member's mapped, mapped+repair and own answers on a window; its gates' lease goes to `gate_log`."""
    tail, prefix, n, qs = run.config.tail_tokens, w.prefix, w.tokens, w.questions
    # Order matters: the exact (own) entry is built last, or the mapped requests would find it and hit it.
    with run.cache.acquire_sync(member, prefix, gate=run.open_gate, tail_tokens=tail) as lease:
        mapped_ids: dict[str, tuple[int, ...]] = {}
        mapped = run.answer(member, "mapped", lease, prefix, n, qs, mapped_ids)
        mapped_logits = run.answer_rows(member, lease, prefix, qs, mapped_ids)
    answers = list(mapped)
    for policy, asked in _repairs(run, member, qs):
        with run.cache.acquire_sync(member, prefix, gate=run.open_gate, tail_tokens=tail, repair=policy) as lease:
            answers += run.answer(member, "mapped+repair", lease, prefix, n, asked)
            repair_costs += [float(str(lease.repair["cost"]))] if lease.repair else []
    # The gates on the same map (a re-prefill when they refuse it: that is then the own prefill, reused).
    with run.cache.acquire_sync(member, prefix, gate=run.config.gate, tail_tokens=tail) as lease:
        gate_log.append(_GateWindow(lease, tuple(q.id for q in qs)))
        probe = next((d.metrics for d in lease.gates if d.gate == "probe"), {})
    with run.cache.acquire_sync(member, prefix, allow_mapped=False) as lease:
        answers += run.answer(member, "own", lease, prefix, n, qs)
        own_starts = run.answer_rows(member, lease, prefix, qs)
    _record_signals(mapped, probe, mapped_logits, mapped_ids, w.source_starts, own_starts)
    return answers


def _repairs(run: _TaskRun, member: str, qs: list[QAQuestion]) -> list[tuple[RepairPolicy, list[QAQuestion]]]:
    """The mapped+repair condition's repairs: one for the window, or one per question focused on it."""
    from agents import suffix_ids

    if run.config.repair_focus != "question":
        return [(run.repair, qs)]
    tok = run.asker.fam.loaded(member).tokenizer
    return [(run.repair.model_copy(update={"focus": tuple(suffix_ids(tok, run.asker.spec(q)))}), [q]) for q in qs]


def _record_signals(mapped: list[QAAnswer], probe: dict[str, float], mapped_logits: dict[str, Tensor],
                    mapped_ids: dict[str, tuple[int, ...]], source_starts: dict[str, Tensor],
                    own_starts: dict[str, Tensor]) -> None:
    """The candidate gates' readings on each mapped answer: the window's probe, the question's answer start
    and how near the answer came to a tie."""
    from orchestra.bench.gate_signals import answer_readings, probe_readings, start_readings

    window = probe_readings(probe)
    for a in mapped:
        rows, own = mapped_logits[a.question], own_starts.get(a.question)
        a.signals = {**window, **start_readings(rows[0], source_starts[a.question][0],
                                                None if own is None else own[0]),
                     **answer_readings(rows, mapped_ids.get(a.question, ()))}


def judged_answers(member: str, answers: list[QAAnswer]) -> list[Judged]:
    """The member's mapped answers as candidate-gate rows: their readings (``answer_differs_source`` read here,
    from the source's own answers), and whether the map harmed or changed the own-prefill answer."""
    from orchestra.bench.gate_signals import Judged
    from orchestra.bench.qa import normalize

    own = {a.question: a for a in answers if a.member == member and a.condition == "own"}
    source = {a.question: a for a in answers if a.condition == "source"}
    judged = []
    for a in answers:
        if a.member != member or a.condition != "mapped" or a.question not in own:
            continue
        signals = dict(a.signals)
        if a.question in source:
            signals["answer_differs_source"] = 1.0 - token_f1(source[a.question].prediction, a.prediction)
        o = own[a.question]
        judged.append(Judged(signals, harmed=o.correct and not a.correct,
                             changed=normalize(o.prediction) != normalize(a.prediction)))
    return judged


def _fill_scores(section: TaskSection, members: list[str], gate_log: dict[str, list[_GateWindow]]) -> None:
    """Each member's and the source's scores per condition, and the gates' summary, from `section.answers`."""
    answers, source, plain = section.answers, section.config.source, section.config.plain
    for m in members:
        own = {a.question: a for a in answers if a.member == m and a.condition == "own"}
        for condition in ("own", "mapped", "mapped+repair", *(("plain",) if plain else ())):
            rows = [a for a in answers if a.member == m and a.condition == condition]
            section.scores.append(score_answers(m, condition, rows, own))
        summary = _gate_summary(m, gate_log[m], answers)
        summary.candidates = score_candidates(judged_answers(m, answers))
        section.gates.append(summary)
    section.scores.append(score_answers(source, "source", [a for a in answers if a.condition == "source"], None))
    if plain:
        section.scores.append(score_answers(source, "plain", [a for a in answers if a.member == source
                                                       and a.condition == "plain"], None))


_Answer = Callable[[str, Condition, "CacheLease", list[int], int, list["QAQuestion"]], list[QAAnswer]]
"""`_TaskRun.answer`(member, condition, lease, prefix, window tokens, questions)."""
_Plain = Callable[[str, str, int, int, list["QAQuestion"]], list[QAAnswer]]
"""`_TaskRun.plain`(member, passage id, window length, window tokens, questions)."""


def _length_row(length: int, member: str, groups: dict[str, list[QAQuestion]],
                window: Callable[[str, int], tuple[list[int], int]], asker: QAAsker, cache: FamilyCache,
                answer: _Answer, progress: bool, plain: _Plain | None = None) -> LengthRow:
    from tqdm.auto import tqdm

    rows: list[QAAnswer] = []
    plain_rows: list[QAAnswer] = []
    prefixes: list[int] = []
    skipped = 0
    types: dict[str, str] = {}
    for pid, qs in tqdm(list(groups.items()), desc=f"tasks @{length}", disable=not progress):
        prefix, n = window(pid, length)
        if asker.fits(member, prefix, qs):
            skipped += len(qs)
            continue
        prefixes.append(len(prefix))
        with cache.acquire_sync(member, prefix, allow_mapped=False) as lease:
            rows += answer(member, "own", lease, prefix, n, qs)
        if plain is not None:
            plain_rows += plain(member, pid, length, n, qs)
        types.update({q.id: q.type for q in qs})
        cache.clear()
    by_type: dict[str, list[bool]] = {}
    for a in rows:
        by_type.setdefault(types[a.question], []).append(a.correct)
    correct = sum(a.correct for a in rows)
    return LengthRow(
        length=length, member=member, n=len(rows), correct=correct, accuracy=correct / len(rows) if rows else 0.0,
        mean_window_tokens=sum(a.window_tokens for a in rows) / len(rows) if rows else 0.0,
        mean_prefix_tokens=sum(prefixes) / len(prefixes) if prefixes else 0.0, skipped=skipped,
        plain_accuracy=sum(a.correct for a in plain_rows) / len(plain_rows) if plain_rows else None,
        by_type={t: sum(v) / len(v) for t, v in sorted(by_type.items())},
        correct_ids=[a.question for a in rows if a.correct],
    )


# -- report -----------------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _pct_in(v: float | None, interval: tuple[float, float] | None) -> str:
    """A share with its 95 % interval: ``82% (59-100%)``."""
    if v is None or interval is None:
        return _pct(v)
    return f"{v:.0%} ({interval[0]:.0%}-{interval[1]:.0%})"


def _lost_gained(s: QAScore) -> str:
    return "" if s.lost is None else f", -{s.lost}/+{s.gained}"


def _repair_words(k: TaskSection) -> str:
    policy = k.repair or {"budget": k.config.repair_budget or 0.1}
    whose = "the bench's" if k.config.repair_budget is not None else "the built-in's own `mapped_repair`"
    interior = float(str(policy.get("scattered_share") or 0))
    reader = ("each question reads on the source (a repaired cache per question)" if k.config.repair_focus == "question"
              else "the source's last tokens read")
    where = f", {interior:.0%} of it on the interior tokens {reader}" if interior else ", on sink and tail tokens"
    spent = (f"; spent {sum(k.repair_costs) / len(k.repair_costs):.0%} of a prefill on average" if k.repair_costs
             else "")
    return f"{whose}: a {float(str(policy['budget'])):.0%} budget{where}{spent}"


def _candidates_markdown(k: TaskSection) -> list[str]:
    from orchestra.bench.gate_signals import SIGNALS, TARGET_CATCH

    rows = [(g.member, c) for g in k.gates for c in g.candidates]
    if not rows:
        return []
    what = {s.name: s.what for s in SIGNALS}
    lines = ["", "### Which reading notices that the map harmed an answer", "",
             "Per question on the pure map: harmed = the own prefill answers right and the map wrong. Each reading "
             f"refuses the questions it reads at or above the threshold that refuses {TARGET_CATCH:.0%} of the harmed "
             "ones (tuned on this set: a second set tests it); false alarm = the other questions it refuses; AUC = "
             "the chance a harmed question reads worse than an unharmed one (0.5: blind). (oracle): needs the "
             "member's own prefill, which no gate has.", "",
             "| member | reading | harmed / questions | threshold | catch | false alarm | changed caught | AUC |",
             "|---|---|---|---|---|---|---|---|"]
    for member, c in rows:
        t = "-" if c.threshold is None else f"{c.threshold:.4g}"
        lines.append(f"| {member} | {c.signal}: {what.get(c.signal, '')}{'' if c.runtime else ' (oracle)'} | "
                     f"{c.harmed}/{c.questions} | {t} | {_pct(c.catch_rate)} | {_pct(c.false_alarm_rate)} | "
                     f"{_pct(c.changed_catch_rate)} | {'-' if c.auc is None else f'{c.auc:.2f}'} |")
    return lines


def _provenance_markdown(k: TaskSection) -> list[str]:
    """What the answers ran on: the FamilyCache lease paths per condition, and each member's mapping."""
    lines: list[str] = []
    by_condition: dict[str, Counter[str]] = {}
    for s in k.scores:
        by_condition.setdefault(s.condition, Counter()).update(s.paths)
    if by_condition:
        lines += ["", "FamilyCache lease paths the answers ran on, all members: " + "; ".join(
            f"{cond} {', '.join(f'{p} {n}' for p, n in paths.items())}" for cond, paths in by_condition.items()) + "."]
    if k.mappings:
        lines += ["", "Mappings the mapped answers ran on: " + "; ".join(
            f"{m} {u.method} on {u.calibration_tokens:,} tokens in windows of {u.window} (held-out KL "
            f"{'-' if u.heldout_kl is None else f'{u.heldout_kl:.4f}'}, calibrated {u.created_at})"
            for m, u in k.mappings.items()) + "."]
    return lines


def tasks_markdown(k: TaskSection) -> list[str]:
    c = k.config
    source = next((s for s in k.scores if s.condition == "source"), None)
    lines = [
        "## Task level: question answering on a mapped vs the member's own cache", "",
        f"{k.dataset}: {k.questions} extractive questions on {k.passages} passages of the bundled licenses, each asked "
        f"over a window of ~{c.window_tokens} document tokens around its passage ({k.mean_prefix_tokens:.0f}-token "
        f"prompt prefix on average); `question_answerer`, greedy, up to {c.max_new_tokens} new tokens; correct = a "
        "reference answer occurs in the reply (normalised). Every cache is a FamilyCache lease: own = the member's "
        f"own prefill, mapped = {c.source}'s cache mapped (gates open, {c.tail_tokens}-token tail recomputed), "
        f"mapped+repair = the same repaired ({_repair_words(k)}), source = {c.source} answering on its own "
        "prefill. Retention = accuracy / own-prefill accuracy; agreement = answers identical to the own-prefill ones "
        "(normalised), and their mean token F1; -lost/+gained = questions the own prefill answers right and the cache "
        "wrong, and the other way round; in brackets, 95 % intervals (retention: paired bootstrap over the questions; "
        "the shares: Wilson); catch = windows where the pure map turned a right own-prefill answer "
        "wrong that the gates refused; false alarm = the other windows the gates refused. "
        "plain = the baseline without orchestra's prompt: the member's chat template over one user turn, the window "
        "then the question, on its own prefill, same budget and stops (no shared prefix).",
        "",
        "| member | n | own | mapped | mapped+repair | plain | source | retention mapped | retention repaired | "
        "agreement mapped (exact / token F1) | would fall back (gates) | gates' catch / false alarm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {s.member: s for s in k.scores if s.condition == "plain"}
    if source is not None:
        base = plain.get(source.member)
        lines.append(f"| {source.member} (source) | {source.n} | {_pct(source.accuracy)} | - | - | "
                     f"{_pct(base.accuracy if base else None)} | {_pct(source.accuracy)} | - | - | - | - | - |")
    for g in k.gates:
        m = g.member
        try:
            own, mapped, rep = (k.score(m, cond) for cond in ("own", "mapped", "mapped+repair"))
        except KeyError:
            continue
        fails = ", ".join(f"{gate} {n}" for gate, n in g.failed_gates.items())
        lines.append(
            f"| {m} | {own.n} | {_pct(own.accuracy)} | {_pct(mapped.accuracy)} | {_pct(rep.accuracy)} | "
            f"{_pct(plain[m].accuracy if m in plain else None)} | {_pct(source.accuracy if source else None)} | "
            f"{_pct_in(mapped.retention, mapped.retention_interval)}{_lost_gained(mapped)} | "
            f"{_pct_in(rep.retention, rep.retention_interval)}{_lost_gained(rep)} | "
            f"{_pct_in(mapped.agreement, mapped.agreement_interval)} / {_pct(mapped.agreement_f1)} | "
            f"{g.fell_back}/{g.windows}{f' ({fails})' if fails else ''} | "
            f"{_pct_in(g.catch_rate, g.catch_interval)} of {g.harmed} / "
            f"{_pct_in(g.false_alarm_rate, g.false_alarm_interval)} |")
    lines += _candidates_markdown(k)
    lines += _provenance_markdown(k)
    if k.lengths:
        types = sorted({t for r in k.lengths for t in r.by_type})
        lines += ["", f"### {k.lengths[0].member}'s own-prefill accuracy vs window length", "",
                  "| window tokens | mean prompt prefix | n | accuracy | plain prompt | " + " | ".join(types)
                  + " | skipped |",
                  "|---|---|---|---|---|" + "---|" * len(types) + "---|"]
        for r in k.lengths:
            lines.append(f"| {r.length} | {r.mean_prefix_tokens:.0f} | {r.n} | {_pct(r.accuracy)} | "
                         f"{_pct(r.plain_accuracy)} | "
                         + " | ".join(_pct(r.by_type.get(t)) for t in types) + f" | {r.skipped} |")
        best = max(k.lengths, key=lambda r: (r.accuracy, -r.length))
        lines += ["", f"Questions answered at {best.length} tokens: {', '.join(best.correct_ids) or 'none'}."]
    lines += [""] + [f"- skipped: {s}" for s in k.skipped] + ([""] if k.skipped else [])
    return lines
