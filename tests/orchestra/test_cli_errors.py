"""The CLI's one error path, table-driven: every command x the bad inputs users give -> exit 2,
one or two ``error:`` lines naming the fix, and no traceback (``--debug`` shows it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestra.cli import app
from orchestra.errors import PipelineFileError
from orchestra.family.corpus import data_text
from tests.tiny_family import build_tiny_family

runner = CliRunner()
DATA = Path(__file__).resolve().parents[2] / "orchestra" / "family" / "data"

AGENT = "{name: s, model: base, builtin: summarizer, args: {max_words: 20, max_new_tokens: 2}}"
BAD_AGENTS = {
    "max_wordz": ("{name: s, model: base, builtin: summarizer, args: {max_wordz: 20}}", "did you mean 'max_words'"),
    "max_new_tokens -5": ("{name: s, model: base, builtin: summarizer, args: {max_new_tokens: -5}}", "from 1 to"),
    "max_new_tokens 0": ("{name: s, model: base, builtin: summarizer, args: {max_new_tokens: 0}}", "from 1 to"),
    "max_new_tokens 1e8": ("{name: s, model: base, builtin: summarizer, args: {max_new_tokens: 1e8}}",
                           "max_new_tokens"),  # YAML reads 1e8 as a string: "not a valid integer"
    "max_new_tokens 1.0e+8": ("{name: s, model: base, builtin: summarizer, args: {max_new_tokens: 1.0e+8}}",
                              "max_new_tokens"),
    "spec max_new_tokens 1e8": ("{name: s, model: base, spec: {task: T, generation: {max_new_tokens: 100000000}}}",
                                "from 1 to"),
    "builtin Field": ("{name: s, model: base, builtin: Field}", "unknown built-in 'Field'"),
    "builtin KeyFacts": ("{name: s, model: base, builtin: KeyFacts}", "did you mean 'key_facts'"),
}


@pytest.fixture(scope="module")
def files(tiny_root, tmp_path_factory) -> dict[str, Path]:
    fam = build_tiny_family(tiny_root, "llama")
    d = tmp_path_factory.mktemp("cli_errors")
    head = f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\nagents:\n"
    out = {"parent": fam.parent, "child": fam.child, "dir": d}
    (d / "good.yaml").write_text(head + f"  - {AGENT}\n")
    out["good"] = d / "good.yaml"
    (d / "bad_utf8.yaml").write_bytes(head.encode() + b"  - {name: s\xff\xfe, model: base}\n")
    out["bad_utf8"] = d / "bad_utf8.yaml"
    for key, (agent, _) in BAD_AGENTS.items():
        path = d / f"{key.replace(' ', '_')}.yaml"
        path.write_text(head + f"  - {agent}\n")
        out[key] = path
    (d / "doc.txt").write_text(data_text("gpl-3.txt")[:300])
    out["doc"] = d / "doc.txt"
    (d / "binary.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    out["binary"] = d / "binary.bin"
    (d / "latin1.txt").write_bytes(("Résumé du rapport annuel: la société a progressé. " * 4).encode("latin-1"))
    out["latin1"] = d / "latin1.txt"
    (d / "home_file").write_text("not a folder")
    out["home_file"] = d / "home_file"
    (d / "foreign").mkdir()
    (d / "foreign" / "notes.txt").write_text("mine")
    out["foreign"] = d / "foreign"
    bad = d / "bad_mapping"  # a real mapping whose manifest names a tensor file outside its folder
    made = runner.invoke(app, [str(a) for a in _calibrate(out, out=bad, more=("--method", "ridge", "--no-stats"))])
    assert made.exit_code == 0, made.output
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["tensors"]["name"] = "../../../../etc/passwd"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    out["bad_mapping"] = bad
    return out


def _calibrate(f, *, corpus=None, out=None, more=()):
    return ["calibrate", "--source", f["parent"], "--target", f["child"], "--corpus", corpus or DATA / "mpl-2.0.txt",
            "--out", out or f["dir"] / "new_mapping", "--tokens", "256", "--window", "32", "--quiet", *more]


def _evaluate(f, *, mapping=None, document=None, more=()):
    return ["evaluate", "--mapping", mapping or f["bad_mapping"], "--document", document or f["doc"], *more]


BINARY = "/bin/ls" if Path("/bin/ls").is_file() else None

# (id, argv builder, text the message must contain)
CASES = [
    ("run non-UTF-8 pipeline", lambda f: ["run", f["bad_utf8"], "--document", f["doc"]], "not UTF-8"),
    ("run binary document", lambda f: ["run", f["good"], "--document", f["binary"]], "is a binary file"),
    ("run /bin/ls document", lambda f: ["run", f["good"], "--document", BINARY or f["binary"]], "is a binary file"),
    ("run latin-1 document", lambda f: ["run", f["good"], "--document", f["latin1"]], "--encoding"),
    ("run unknown --encoding", lambda f: ["run", f["good"], "--document", f["latin1"], "--encoding", "klingon"],
     "unknown encoding"),
    ("run folder as document", lambda f: ["run", f["good"], "--document", f["dir"]], "is a folder"),
    ("run missing document", lambda f: ["run", f["good"], "--document", f["dir"] / "none.txt"], "does not exist"),
    ("run missing pipeline", lambda f: ["run", f["dir"] / "none.yaml", "--document", f["doc"]], "does not exist"),
    *[(f"run {key}", lambda f, key=key: ["run", f[key], "--document", f["doc"]], why)
      for key, (_, why) in BAD_AGENTS.items()],
    ("graph non-UTF-8 pipeline", lambda f: ["graph", f["bad_utf8"]], "not UTF-8"),
    ("graph binary pipeline", lambda f: ["graph", BINARY or f["binary"]], "binary file"),
    *[(f"graph {key}", lambda f, key=key: ["graph", f[key]], why) for key, (_, why) in BAD_AGENTS.items()],
    ("calibrate binary corpus", lambda f: _calibrate(f, corpus=f["binary"]), "is a binary file"),
    ("calibrate latin-1 corpus", lambda f: _calibrate(f, corpus=f["latin1"]), "--encoding"),
    ("calibrate missing corpus", lambda f: _calibrate(f, corpus=f["dir"] / "none.txt"), "does not exist"),
    ("calibrate --out a file", lambda f: _calibrate(f, out=f["home_file"]), "not a folder"),
    ("calibrate --out /dev/full", lambda f: _calibrate(f, out=Path("/dev/full")), "not a folder"),
    ("calibrate --out a folder of other files", lambda f: _calibrate(f, out=f["foreign"]), "other files"),
    ("evaluate binary document", lambda f: _evaluate(f, document=f["binary"]), "is a binary file"),
    ("evaluate latin-1 document", lambda f: _evaluate(f, document=f["latin1"]), "--encoding"),
    ("evaluate tensor name outside the folder", lambda f: _evaluate(f), "plain file name"),
    ("evaluate missing mapping", lambda f: _evaluate(f, mapping=f["dir"] / "none"), "not a mapping directory"),
    ("calibrate-repair bad mapping",
     lambda f: ["calibrate-repair", "--mapping", f["bad_mapping"], "--corpus", f["doc"]], "plain file name"),
    ("calibrate-repair binary corpus",
     lambda f: ["calibrate-repair", "--mapping", f["dir"] / "none", "--corpus", f["binary"]], "not a mapping"),
    ("family show: home is a file", lambda f: ["family", "show", "--home", f["home_file"]], "not a directory"),
    ("family show: no family", lambda f: ["family", "show", "--home", f["dir"] / "empty_home"],
     "orchestra family build"),
    ("serve: a repair ladder that is not numbers", lambda f: ["serve", "--repair-ladder", "low,high", "--home",
                                                              f["dir"] / "nohome"], "comma-separated list of numbers"),
    ("serve: the pipelines' vllm executor", lambda f: ["serve", "--executor", "vllm", "--home", f["dir"] / "nohome"],
     "use --engine vllm"),
    ("serve: a repair budget above a whole prefill", lambda f: ["serve", "--repair-ladder", "0.1,2", "--home",
                                                                f["dir"] / "nohome"], "--repair"),
    ("family build: home is a file", lambda f: ["family", "build", "--home", f["home_file"]], "not a directory"),
    ("family init: no such model folder", lambda f: ["family", "init", "mine", f["dir"] / "no_model",
                                                      "--home", f["dir"] / "init_home"], "does not exist"),
    ("family init: home is a file", lambda f: ["family", "init", "mine", f["good"], "--home", f["home_file"]],
     "not a directory"),
    ("family calibrate: home is a file", lambda f: ["family", "calibrate", "--home", f["home_file"]],
     "not a directory"),
    ("family train-delta: unknown delta", lambda f: ["family", "train-delta", "nope", "--home", f["home_file"]],
     "unknown delta"),
    ("demo: home is a file", lambda f: ["demo", "--home", f["home_file"]], "not a directory"),
    ("cache ls: home is a file", lambda f: ["cache", "ls", "--home", f["home_file"]], "not a directory"),
    ("cache rm: no such key", lambda f: ["cache", "rm", "nosuchkey", "--store", f["dir"] / "kv"],
     "no stored cache has a key starting 'nosuchkey'"),
    ("cache rm: nothing named", lambda f: ["cache", "rm", "--store", f["dir"] / "kv"], "or pass --all"),
    ("cache prune: home is a file", lambda f: ["cache", "prune", "--home", f["home_file"]], "not a directory"),
    ("run --resume of no such run", lambda f: ["run", f["good"], "--document", f["doc"], "--resume", "nosuchrun",
                                                "--home", f["dir"] / "nohome"], "no run 'nosuchrun' to resume"),
    ("bench: unknown section", lambda f: ["bench", "--sections", "bogus", "--home", f["home_file"]], "bogus"),
]


def _check(result, why: str) -> None:
    output = result.output
    assert result.exit_code == 2, output
    assert "Traceback" not in output, output
    assert why in " ".join(output.split()), output
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "error" in line.lower())
    assert len([line for line in lines[start:] if line.strip()]) <= 2, output  # one or two lines


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_exit_2_and_one_line(files, case):
    _, argv, why = case
    _check(runner.invoke(app, [str(a) for a in argv(files)]), why)


def test_report_to_a_full_disk_after_a_finished_run(files):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    result = runner.invoke(app, ["run", str(files["good"]), "--document", str(files["doc"]),
                                 "--report", "/dev/full", "--home", str(files["dir"] / "nohome")])
    assert result.exit_code == 2, result.output
    assert "cannot write the report to /dev/full" in result.output and "No space left" in result.output
    assert "Traceback" not in result.output
    assert Path("/dev/full").is_char_device()  # written in place, never replaced by a rename


def test_latin1_document_runs_with_encoding(files):
    result = runner.invoke(app, ["run", str(files["good"]), "--document", str(files["latin1"]),
                                 "--encoding", "latin-1", "--home", str(files["dir"] / "nohome")])
    # exit 3 only when the tiny model's reply is judged degenerate: the document was read and run
    assert result.exit_code == 0 or (result.exit_code == 3 and " degenerate" in result.output), result.output


def test_debug_shows_the_traceback(files):
    result = runner.invoke(app, ["--debug", "graph", str(files["bad_utf8"])])
    assert result.exit_code == 1 and isinstance(result.exception, PipelineFileError)
    quiet = runner.invoke(app, ["graph", str(files["bad_utf8"])])
    assert quiet.exit_code == 2 and quiet.exception is not None and "Traceback" not in quiet.output


def test_every_command_is_covered():
    """A new command gets rows in the table above (serve has its own bad-input tests)."""
    import typer.main

    root = typer.main.get_command(app)
    covered = {" ".join(c[1](_Names())[:2]) if c[1](_Names())[0] in ("family", "cache") else c[1](_Names())[0]
               for c in CASES}
    names = set()
    for name, cmd in root.commands.items():
        for sub in getattr(cmd, "commands", {}) or {}:
            names.add(f"{name} {sub}")
        if not getattr(cmd, "commands", None):
            names.add(name)
    assert names - covered <= {"serve"}, names - covered


class _Names(dict):
    def __missing__(self, key):
        return Path(key)


def test_a_copy_of_the_demo_pipeline_with_a_typo_is_refused_by_graph_and_run(files, tmp_path):
    demo = Path(__file__).resolve().parents[2] / "examples" / "long_document_analysis" / "pipeline.yaml"
    copy = tmp_path / "demo.yaml"
    shutil.copy(demo, copy)
    copy.write_text(copy.read_text().replace("max_words: 80", "max_wordz: 80"))
    for argv in (["graph", copy], ["run", copy, "--document", files["doc"]]):
        _check(runner.invoke(app, [str(a) for a in argv]), "did you mean 'max_words'")


def test_serve_settings_come_from_orchestra_environment_variables_below_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRA_REPAIR_LADDER", "low,high")
    result = runner.invoke(app, ["serve", "--home", str(tmp_path / "nohome")])
    assert result.exit_code == 2 and "comma-separated list of numbers" in result.output  # read from the environment
    result = runner.invoke(app, ["serve", "--home", str(tmp_path / "nohome"), "--repair-ladder", "0.1,2"])
    assert result.exit_code == 2 and "--repair" in result.output and "numbers" not in result.output  # the flag wins
