"""Your own family, end to end: a base and instruct pair, a LoRA adapter and an int8 view, one pipeline.

    python examples/own_family/run.py --base Qwen/Qwen2.5-0.5B --instruct Qwen/Qwen2.5-0.5B-Instruct \\
        --adapter ./loras/legal --document contract.txt --home ~/qwen-family

`--base` and `--instruct` are model folders or Hub ids (``org/name[@revision]``, fetched into your
Hugging Face cache; with ``HF_HUB_OFFLINE=1`` read from it only). `--adapter` is a peft LoRA adapter
folder trained over the base. The script does what a user types:

1. ``orchestra family init own base=BASE instruct=INSTRUCT --home HOME --calibrate --force`` (through the
   CLI's own entry point, in this process): the two models become the members ``base`` (the source) and
   ``instruct`` of a family in HOME, and the base -> instruct map is fitted;
2. runs ``pipeline.yaml`` (next to this file) on that family, its ``legal`` adapter pointed at `--adapter`:
   the document is prefilled once, on ``base``; ``instruct``, the adapter and the int8 view of the base
   (``base8``: torchao, the ``quant`` extra; left out with a note when torchao is not
   installed) run on that cache mapped into them (base -> adapter and base -> view are fitted on demand);
3. prints each agent's cache path (exact, mapped, or reprefilled when a gate refused the map) and output.

A missing document or adapter folder, or a model that cannot be found, is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestra import RunReport

HERE = Path(__file__).resolve().parent
PIPELINE = HERE / "pipeline.yaml"


def family_init(name: str, base: str, instruct: str, home: Path, tokens: int) -> int:
    """`orchestra family init` through the CLI's entry point; its exit code (2 and one error line on a bad model)."""
    from orchestra.cli import app

    args = ["family", "init", name, f"base={base}", f"instruct={instruct}", "--home", str(home),
            "--calibrate", "--tokens", str(tokens), "--force"]
    print("$ orchestra " + " ".join(args), flush=True)
    try:
        app(args, prog_name="orchestra")
    except SystemExit as done:  # click ends every command with SystemExit, 0 included
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def pipeline_spec(adapter: Path, tokens: int, *, int8: bool) -> dict[str, Any]:
    """pipeline.yaml with the adapter folder filled in (and the int8 view's agent left out when `int8` is False)."""
    import yaml

    data: dict[str, Any] = yaml.safe_load(PIPELINE.read_text(encoding="utf-8"))
    data["models"]["legal"]["adapter"] = str(adapter)
    data["mapping"]["tokens"] = tokens
    if not int8:
        del data["models"]["base8"]
        data["agents"] = [a for a in data["agents"] if a["model"] != "base8"]
    return data


def run(document: str, adapter: Path, home: Path, *, tokens: int, int8: bool) -> RunReport:
    """The pipeline over `document` on the family in `home`."""
    from orchestra import Pipeline, PipelineSpec

    spec = PipelineSpec.model_validate(pipeline_spec(adapter, tokens, int8=int8))
    with Pipeline.from_spec(spec, home=home) as pipeline:
        return pipeline.run_sync(document)


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base model: a folder or a Hub id org/name[@revision]")
    parser.add_argument("--instruct", required=True, help="its instruct sibling: a folder or a Hub id")
    parser.add_argument("--adapter", required=True, type=Path, help="a peft LoRA adapter folder over the base")
    parser.add_argument("--document", required=True, type=Path, help="a text file")
    parser.add_argument("--home", required=True, type=Path, help="where the family's manifest and maps go")
    parser.add_argument("--name", default="own", help="the family's name (default: own)")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration tokens per map (default: 8192)")
    parser.add_argument("--report", type=Path, help="also write the run report as JSON here")
    args = parser.parse_args(argv)

    if not args.document.is_file():
        return _error(f"--document {args.document} is not a file")
    if not (args.adapter / "adapter_config.json").is_file():
        what = "does not exist" if not args.adapter.exists() else "has no adapter_config.json (peft's save_pretrained)"
        return _error(f"--adapter {args.adapter} {what}")
    int8 = importlib.util.find_spec("torchao") is not None
    if not int8:
        from orchestra.errors import install_command

        print(f"note: the int8 view `base8` needs torchao ({install_command('quant')}); running without it", flush=True)

    code = family_init(args.name, args.base, args.instruct, args.home, args.tokens)
    if code != 0:
        return code
    from orchestra import OrchestraError

    try:
        report = run(args.document.read_text(encoding="utf-8"), args.adapter.resolve(), args.home,
                     tokens=args.tokens, int8=int8)
    except OrchestraError as exc:
        return _error(str(exc))

    print(f"\ndocument: {report.document_tokens} tokens, prefilled on "
          f"{', '.join(c.model for c in report.caches if c.path == 'exact')}")
    for agent in report.agents:
        cache: str = agent.cache_path or "-"
        if agent.fallback_reason:
            cache += f" (fallback: {agent.fallback_reason})"
        print(f"== {agent.name} on {agent.model} ({agent.status}, cache: {cache})")
        print(agent.output if agent.status == "succeeded" else agent.error or agent.skip_reason)
    print(f"prefill seconds spent {report.prefill_s_spent:.2f}, saved {report.prefill_s_saved:.2f}; "
          f"run {report.seconds:.1f}s")
    if args.report is not None:
        args.report.write_text(report.model_dump_json(indent=2), encoding="utf-8")
    return 0 if all(a.status == "succeeded" for a in report.agents) else 1


if __name__ == "__main__":
    sys.exit(main())
