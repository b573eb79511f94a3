"""A command's settings from a file (`--config FILE` / ``ORCHESTRA_CONFIG``), under its flags and environment.

Precedence, highest first: a flag on the command line, its ``ORCHESTRA_*`` environment variable, the config
file, the built-in default. The file is YAML (or JSON) or TOML (``.toml``), a mapping of option names as the
flags spell them, with or without the dashes (``cache-mb: 1024`` or ``cache_mb = 1024``); its values are
converted and validated exactly as the flag's would be. A key that is not an option of the command, or a value
it refuses, is one error line naming the key (exit 2).
"""

from __future__ import annotations

from pathlib import Path

import typer

from orchestra.errors import OrchestraError

__all__ = ["file_settings", "read_settings_file"]


def read_settings_file(path: Path) -> dict[str, object]:
    """The file's mapping of settings (YAML, JSON or TOML), or an OrchestraError saying what to fix."""
    if not path.is_file():
        raise OrchestraError(f"--config {path}: no such file; give the path of a YAML or TOML settings file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data: object = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ModuleNotFoundError:
        raise OrchestraError(f"--config {path}: reading TOML on Python 3.10 needs tomli (pip install tomli), or "
                             "write the file as YAML") from None
    except Exception as exc:  # the parsers' own errors: the file is not valid YAML/TOML
        raise OrchestraError(f"--config {path}: not valid {'TOML' if path.suffix.lower() == '.toml' else 'YAML'} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OrchestraError(f"--config {path}: the file must be a mapping of option names to values, not a "
                             f"{type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def file_settings(ctx: typer.Context, path: Path) -> dict[str, object]:
    """The file's settings for `ctx`'s command, as its parameters' values, for the options neither given as
    flags nor set in the environment (those win over the file)."""
    params = {p.name: p for p in ctx.command.params if p.param_type_name == "option" and p.name}
    by_flag = {flag.lstrip("-"): p.name for p in params.values() for flag in p.opts if p.name}
    out: dict[str, object] = {}
    for key, value in read_settings_file(path).items():
        name = by_flag.get(key) or by_flag.get(key.replace("_", "-")) or (key if key in params else None)
        if name is None or name == "config_file":
            known = ", ".join(sorted(k for k, n in by_flag.items() if n != "config_file"))
            raise OrchestraError(f"--config {path}: {key!r} is not an option of `orchestra {ctx.info_name}` "
                                 f"(it has {known})")
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            continue  # a flag or an environment variable said otherwise
        param = params[name]
        try:
            out[name] = param.process_value(ctx, value)
        except typer.BadParameter as exc:
            raise OrchestraError(f"--config {path}: {key}: {exc.message}") from None
    return out
