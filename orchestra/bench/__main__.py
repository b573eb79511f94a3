"""``python -m orchestra.bench [OPTIONS]``: the same as ``orchestra bench``."""

from __future__ import annotations

import typer

from orchestra.bench._cli import bench


def main() -> None:
    typer.run(bench)


if __name__ == "__main__":
    main()
