"""What a user's install costs: the core install's size and distributions, and `import orchestra` time.

For each tree given (the working tree by default, or a git revision checked out into a temporary
worktree), a fresh venv gets what the README's first command installs, less the demo itself:
``pip install torch==2.13.0`` then ``pip install <tree><extras>``. Measured in that venv:

- site-packages size with and without torch (torch's CPU wheel dwarfs everything else, and is the
  user's choice, not ours), and the number of distributions installed;
- `import orchestra` (fastest of N fresh interpreters) and `orchestra --help` (likewise);
- which heavy modules `import orchestra` pulls in (torch, transformers must not be among them).

Writes ``benchmarks/results/install_footprint.{json,md}``; compare revisions in one run, e.g.
``python benchmarks/install_footprint.py --rev 2b0b7d9 --rev WORKTREE``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _revs import ROOT, remove_tree, run
from _revs import tree as checkout

RESULTS = ROOT / "benchmarks" / "results"
HEAVY = ("torch", "transformers", "xgrammar", "peft", "gguf", "matplotlib", "fastapi", "ray")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _fastest(cmd: list[str], repeats: int, env: dict[str, str]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(cmd, env=env)
        best = min(best, time.perf_counter() - start)
    return best


def measure(rev: str, extras: str, repeats: int, scratch: Path) -> dict[str, object]:
    """Install `rev` into a fresh venv the way the README does and measure it."""
    tree = checkout(rev, scratch)
    venv = scratch / f"venv-{rev}"
    run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": str(scratch / "home")}
    start = time.perf_counter()
    run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], env=env)
    torch_s = time.perf_counter() - start
    start = time.perf_counter()
    run([py, "-m", "pip", "install", "-q", f"{tree}{extras}"], env=env)
    install_s = time.perf_counter() - start
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    dists = json.loads(run([py, "-m", "pip", "list", "--format", "json"], env=env).stdout)
    torch_dirs = [site / name for name in ("torch", "functorch", "torchgen", "triton")]
    total = _size(site)
    torch_bytes = sum(_size(d) for d in torch_dirs if d.exists())
    nvidia = site / "nvidia"
    if nvidia.exists():
        torch_bytes += _size(nvidia)
    loaded = json.loads(run([py, "-c", "import json, sys, orchestra, agents, mappings; "
                                        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"],
                             env=env, cwd=scratch).stdout)
    exe = str(venv / "bin" / "orchestra")
    row: dict[str, object] = {
        "rev": rev if rev != "WORKTREE" else "working tree",
        "extras": extras or "(core)",
        "distributions": len(dists),
        "site_packages_mb": round(total / 2**20, 1),
        "without_torch_mb": round((total - torch_bytes) / 2**20, 1),
        "pip_install_s": round(install_s, 1),
        "torch_install_s": round(torch_s, 1),
        "import_orchestra_s": round(_fastest([py, "-c", "import orchestra"], repeats, env), 3),
        "orchestra_help_s": round(_fastest([exe, "--help"], repeats, env), 3),
        "heavy_modules_on_import": loaded,
        "packages": sorted(d["name"].lower() for d in dists),
    }
    if tree != ROOT:
        remove_tree(tree)
    return row


def _markdown(rows: list[dict[str, object]]) -> str:
    cols = ["rev", "extras", "distributions", "site_packages_mb", "without_torch_mb", "pip_install_s",
            "import_orchestra_s", "orchestra_help_s", "heavy_modules_on_import"]
    lines = ["# Install footprint", "",
             "`python benchmarks/install_footprint.py " + " ".join(f"--rev {r['rev']}" for r in rows) + "`: a fresh "
             "venv per row, `pip install torch==2.13.0` then the tree with its extras; import times are the fastest "
             "of N fresh interpreters. Sizes in MiB of site-packages.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        gone = sorted(set(first["packages"]) - set(last["packages"]))  # type: ignore[arg-type]
        added = sorted(set(last["packages"]) - set(first["packages"]))  # type: ignore[arg-type]
        lines += ["", f"Distributions dropped from the first row to the last: {', '.join(gone) or '-'}.",
                  f"Added: {', '.join(added) or '-'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", action="append", help="a git revision, or WORKTREE (default: WORKTREE)")
    parser.add_argument("--extras", default="", help="extras to install with the tree, e.g. '[build]'")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "install_footprint.json")
    args = parser.parse_args(argv)
    revs = args.rev or ["WORKTREE"]
    scratch = Path(tempfile.mkdtemp(prefix="footprint-"))
    try:
        rows = [measure(rev, args.extras, args.repeats, scratch) for rev in revs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    tmp.replace(args.out)
    md = args.out.with_suffix(".md")
    tmp_md = md.with_suffix(".md.tmp")
    tmp_md.write_text(_markdown(rows))
    tmp_md.replace(md)
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
