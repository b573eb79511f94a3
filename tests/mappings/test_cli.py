"""`orchestra calibrate` / `orchestra evaluate` through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from orchestra.commands.mapping import app
from tests.mappings.conftest import DATA, TOKENS, WINDOW

runner = CliRunner()


def test_calibrate_then_evaluate(llama_family, tmp_path):
    out = tmp_path / "map"
    result = runner.invoke(app, [
        "calibrate", "--source", str(llama_family.parent), "--target", str(llama_family.child),
        "--corpus", str(DATA / "apache-2.0.txt"), "--corpus", str(DATA / "mpl-2.0.txt"),
        "--out", str(out), "--tokens", str(TOKENS), "--window", str(WINDOW),
    ])
    assert result.exit_code == 0, result.output
    assert "pair card" in result.output and "wrote" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"]["name"] == "anchored_kl"
    assert manifest["calibration"]["corpus_names"] == ["apache-2.0.txt", "mpl-2.0.txt"]

    report_path = tmp_path / "report.json"
    result = runner.invoke(app, [
        "evaluate", "--mapping", str(out), "--document", str(DATA / "gpl-3.txt"),
        "--prefix-tokens", "128", "--suffix-tokens", "16", "--json", str(report_path),
        "--tail-tokens", "16", "--greedy-tokens", "8",
    ])
    assert result.exit_code == 0, result.output
    assert "reprefill" in result.output and "anchored_kl" in result.output
    data = json.loads(report_path.read_text())
    methods = {row["method"]: row for row in data["methods"]}
    assert {"reprefill", "identity", "ridge", "anchored", "anchored_kl"} <= set(methods)
    for row in methods.values():
        assert {"method", "kl", "top1", "top5", "nll_delta", "map_seconds", "prefill_seconds"} <= set(row)
    assert data["source"]["fingerprint"]["combined"] == manifest["source"]["fingerprint"]["combined"]
    assert data["target"]["fingerprint"]["combined"] == manifest["target"]["fingerprint"]["combined"]
    assert (tmp_path / "report_layers.png").exists()
    # the product path: what the FamilyCache serves an agent on the target, gated
    assert "served by FamilyCache" in result.output
    served = json.loads((tmp_path / "report_served.json").read_text())
    assert [w["path"] for w in served["windows"]] in (["mapped"], ["reprefilled"])
    window = served["windows"][0]
    assert {g["gate"] for g in window["gates"]} == {"offline", "probe"}
    assert (window["path"] == "reprefilled") == any(not g["passed"] for g in window["gates"])
    if window["path"] == "reprefilled":  # a re-prefilled cache is the truth itself
        assert window["kl"] < 1e-6 and window["top1"] == 1.0


def test_typed_errors_become_one_line_and_exit_code_2(llama_family, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("far too short to calibrate on")
    result = runner.invoke(app, [
        "calibrate", "--source", str(llama_family.parent), "--target", str(llama_family.child),
        "--corpus", str(short), "--out", str(tmp_path / "m"), "--tokens", "512", "--window", "64", "--quiet",
    ])
    assert result.exit_code == 2
    assert "CorpusTooSmallError" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "m").exists()

    result = runner.invoke(app, ["evaluate", "--mapping", str(tmp_path), "--document", str(short)])
    assert result.exit_code == 2 and "CorruptMappingError" in result.output and "Traceback" not in result.output


def test_every_option_has_help():
    import typer

    group = typer.main.get_command(app)
    for name in ("calibrate", "evaluate"):
        command = group.commands[name]
        assert command.help
        for param in command.params:
            if param.name != "help":
                assert getattr(param, "help", None), f"{name} --{param.name} has no help text"


def test_repair_options_and_calibrate_repair(llama_family, tmp_path):
    """--repair rows, a layer share without residual maps refused with a typed error, then calibrate-repair
    adds the residual maps so the same evaluation runs; a missing mapping directory is a one-line error.
    (The 4-layer llama: half of a 50 % budget is 1 layer, and its worst layer is not layer 0.)"""
    from mappings.calibrate import calibrate

    path = tmp_path / "map"
    calibrate(llama_family.parent, llama_family.child, [(p.name, p.read_text()) for p in
              (DATA / "apache-2.0.txt", DATA / "mpl-2.0.txt")], tokens=TOKENS, window=WINDOW, progress=False).save(path)
    base = ["evaluate", "--mapping", str(path), "--document", str(DATA / "gpl-3.txt"), "--prefix-tokens", "96",
            "--suffix-tokens", "16", "--greedy-tokens", "0", "--tail-tokens", "0", "--no-layer-curves",
            "--repair-costs", "compute"]  # a tiny model's every pass costs ~its prefill in seconds
    result = runner.invoke(app, [*base, "--repair", "0.5", "--repair-layers", "0.5"])
    assert result.exit_code == 2 and "RepairUnavailableError" in result.output and "calibrate-repair" in result.output
    result = runner.invoke(app, ["calibrate-repair", "--mapping", str(path), "--corpus", str(DATA / "apache-2.0.txt"),
                                 "--corpus", str(DATA / "mpl-2.0.txt"), "--tokens", str(TOKENS), "--window", str(WINDOW)])
    assert result.exit_code == 0, result.output
    assert (path / "residual.safetensors").is_file()
    report = tmp_path / "r.json"
    result = runner.invoke(app, [*base, "--repair", "0.5", "--repair-layers", "0.5", "--json", str(report)])
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(report.read_text())["methods"]}
    row = rows["anchored_kl+repair@50%,L0.5"]
    assert row["repair"]["blocks"] and row["cost_fraction"] <= 0.5 + 1e-9
    missing = runner.invoke(app, ["calibrate-repair", "--mapping", str(tmp_path / "nope"), "--corpus",
                                  str(DATA / "mpl-2.0.txt")])
    assert missing.exit_code == 2 and "CorruptMappingError" in missing.output
