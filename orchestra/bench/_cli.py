"""`orchestra bench`: mapped caches vs re-prefill on the bundled family (quality, cost, tasks, pipelines)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

app = typer.Typer()

_DEFAULT_OUT = Path("benchmarks/results")


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _ints(value: str | None, what: str) -> list[int] | None:
    items = _split(value)
    if items is None:
        return None
    try:
        return [int(v.lower().replace("k", "")) * (1024 if v.lower().endswith("k") else 1) for v in items]
    except ValueError as exc:
        raise typer.BadParameter(f"{what} must be comma-separated integers (e.g. 512,1k): {value!r}") from exc


def _command() -> str:
    argv0 = Path(sys.argv[0]).name if sys.argv else "orchestra"
    head = ["python", "-m", "orchestra.bench"] if argv0 == "__main__.py" else ["orchestra", "bench"]
    args = sys.argv[1:] if argv0 == "__main__.py" else sys.argv[2:]
    return shlex.join(head + list(args))


@app.command("bench")
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="A few minutes: lengths 512/1k, one window, forward pairs + "
                                        "one reverse, a 2-agent pipeline, short agent outputs.")] = False,
    out: Annotated[Path, typer.Option("--out", help="Folder for bench.json, bench.md and the PNG plots; or a file "
                                      "NAME.json: the results go to NAME.json and NAME.md beside it (e.g. "
                                      "benchmarks/results/qa.json for a tasks-only run).")] = _DEFAULT_OUT,
    pairs: Annotated[str | None, typer.Option("--pairs", help="Comma-separated SOURCE>TARGET aliases (root, finetuned, "
                                              "int8, quantized, distilled), e.g. 'root>finetuned,finetuned>root'.")] = None,
    lengths: Annotated[str | None, typer.Option("--lengths", help="Comma-separated document lengths in tokens, e.g. "
                                                "'512,1k,2k'.")] = None,
    sections: Annotated[str | None, typer.Option("--sections", help="Comma-separated sections to run: crossfamily, "
                                                 "quality, repair, timing, tasks, pipeline, calibration (default: all).")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", min=1, help="Timing repetitions (median).")] = None,
    windows: Annotated[int | None, typer.Option("--windows", min=1, help="Quality windows per length.")] = None,
    agents: Annotated[str | None, typer.Option("--agents", help="Pipeline sizes, e.g. '2,4,8'.")] = None,
    qa_window: Annotated[int | None, typer.Option("--qa-window", min=16, help="Tasks: document tokens of the window "
                                                  "around each question's passage (default 512).")] = None,
    qa_lengths: Annotated[str | None, typer.Option("--qa-lengths", help="Tasks: also measure the source's own-prefill "
                                                   "accuracy at these window lengths, e.g. '256,512,1k,2k'.")] = None,
    qa_limit: Annotated[int | None, typer.Option("--qa-limit", min=1, help="Tasks: ask only the first N questions "
                                                 "(default: all; 12 with --quick).")] = None,
    qa_questions: Annotated[str | None, typer.Option("--qa-questions", help="Tasks: comma-separated question ids "
                                                     "(orchestra/bench/data/qa.json) to ask.")] = None,
    qa_file: Annotated[Path | None, typer.Option("--qa-file", help="Tasks: another QA set: 'qa_heldout.json' (the "
                                                 "bundled held-out set) or a file of your own (the format of "
                                                 "orchestra/bench/data/qa.json).")] = None,
    qa_max_new_tokens: Annotated[int | None, typer.Option("--qa-max-new-tokens", min=1, help="Tasks: tokens per "
                                                          "answer (default 24).")] = None,
    qa_repair_budget: Annotated[float | None, typer.Option("--qa-repair-budget", min=0.0, max=1.0, help="Tasks: repair "
                                                           "budget of the mapped+repair condition (default: the "
                                                           "question answerer's own repair).")] = None,
    qa_repair_focus: Annotated[Literal["tail", "question"], typer.Option(
        "--qa-repair-focus", help="Tasks: what ranks the tokens the repair recomputes: 'tail' (the document's last "
        "tokens) or 'question' (each question: a repaired cache per question).")] = "tail",
    repair_costs: Annotated[Literal["measured", "compute"], typer.Option("--repair-costs", help="How repair budgets are priced: 'measured' "
                                              "(the target's timed passes on this machine) or 'compute' "
                                              "(multiply-adds).")] = "measured",
    home: Annotated[Path | None, typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or "
                                              "~/.cache/orchestra).")] = None,
    device: Annotated[str, typer.Option("--device", help="Torch device for every model.")] = "cpu",
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """Benchmark mapped KV caches against re-prefill on the bundled family, writing JSON, Markdown and plots."""
    from mappings.errors import MappingError
    from orchestra.bench import BenchConfig, run_bench
    from orchestra.commands._output import console, print_error
    from orchestra.errors import OrchestraError

    try:
        config = BenchConfig(
            quick=quick, pairs=_split(pairs), lengths=_ints(lengths, "--lengths"),
            repeats=repeats, windows=windows, pipeline_agents=_ints(agents, "--agents"), device=device,
            task_tokens=qa_window, task_max_new_tokens=qa_max_new_tokens, qa_lengths=_ints(qa_lengths, "--qa-lengths"),
            qa_limit=qa_limit, qa_questions=_split(qa_questions), qa_file=str(qa_file) if qa_file else None,
            qa_repair_budget=qa_repair_budget, qa_repair_focus=qa_repair_focus, repair_costs=repair_costs,
            **({"sections": _split(sections)} if sections else {}),
        )
        result = run_bench(config, out, home=home, command=_command(), progress=not quiet,
                           log=None if quiet else console.print)
    except (OrchestraError, MappingError, ValueError) as exc:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):  # one line: the option and what is wrong with it
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            message = f"--{where.replace('_', '-')}: {first.get('msg', exc)}".replace("Value error, ", "")
            print_error(message)
        else:
            print_error(str(exc), exc)
        raise typer.Exit(2) from exc
    from orchestra.bench.report import result_paths

    json_path, md_path = result_paths(out)
    console.print(f"wrote {json_path}, {md_path}" +
                  (f" and {', '.join(result.plots)}" if result.plots else "") + f" in {result.seconds:.0f} s")
