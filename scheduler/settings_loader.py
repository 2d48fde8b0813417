"""Load a pydantic-settings model from CLI flags, environment variables and a YAML file.

Precedence: CLI flags > environment (PREFIX_FIELD) > YAML file (--config) > defaults.
An invalid value stops start-up with one line that names the field.

The scheduler must not import `inference_worker` (and the router imports this one), so it keeps
this small loader of its own, a twin of the worker's.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsError

SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def known_log_level(value: str) -> str:
    """A logging level's name, any case. Checked with the config: logging.basicConfig raised an
    unknown one as a traceback after the config was taken."""
    if value.upper() not in logging.getLevelNamesMapping():
        raise ValueError("log_level must be one of debug, info, warning, error, critical")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def clean_secret(value: str | None) -> str | None:
    """A token from a flag, the environment or a YAML file, as a client sends it after
    `Authorization: Bearer `: without the whitespace around it, and refused if a control character
    is left in it. Why: a Kubernetes Secret made from a file keeps the file's last newline, which
    no Bearer header carries (a header cannot hold a line break, and the token is read stripped),
    so the token matched nothing and every call was a 401; sent by us, aiohttp refuses the
    header, so every call failed. Empty: no token, as before."""
    if value is None:
        return None
    value = value.strip()
    if _CONTROL.search(value):
        raise ValueError("a token must not hold a control character (a line break, a tab, ...)")
    return value or None


def _yaml_values(path: str | None) -> dict:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: bytes that are not UTF-8
        reason = " ".join(str(exc).split())  # YAML errors span lines; the contract is one
        raise SystemExit(f"error: cannot read config file {path}: {reason}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"error: config file {path} must hold a mapping of field: value")
    keys = [k for k in data if not isinstance(k, str)]
    if keys:  # YAML keys may be numbers, lists, ...: `{1: 2}` was an AttributeError traceback
        raise SystemExit(f"error: config file {path} must hold a mapping of field: value "
                         f"(got the key {keys[0]!r})")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _config_path(argv: list[str], env_var: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    # Like every field, the path may be given in the environment (SCHEDULER_CONFIG, ...): it was
    # taken as the field's value and the file never read.
    return os.environ.get(env_var) or None


# Fields whose value is a secret: their error line names them but does not echo the value,
# which went to the logs (a token with a stray control character was printed whole).
_SECRET_FIELD = re.compile(r"(token|api_keys?|password|secret)$")


def format_validation_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "config"
    if not err["loc"]:
        # A check across fields: its input is every value given, secrets included (an API key,
        # a token) and went to the logs whole. The message names the options.
        shown = ""
    elif _SECRET_FIELD.search(field):
        shown = "(value hidden)"
    else:
        shown = f"(got {err.get('input')!r})"
    return f"error: invalid value for {field.replace('_', '-')}: {err['msg']} {shown}".rstrip()


def load_settings(model: type[SettingsT], argv: list[str] | None = None) -> SettingsT:
    """Parse settings; exits with a one-line message on any invalid value."""
    argv = sys.argv[1:] if argv is None else argv
    prefix = str(model.model_config.get("env_prefix", "")).upper()
    yaml_values = _yaml_values(_config_path(argv, f"{prefix}CONFIG"))
    try:
        return CliApp.run(model, cli_args=argv, **_yaml_as_init(model, yaml_values))
    except ValidationError as exc:
        raise SystemExit(format_validation_error(exc)) from None
    except SettingsError as exc:  # a flag or variable that should hold JSON and does not parse
        # From the environment the message names the field and source but not what is wrong:
        # that is the error it was raised from (a JSONDecodeError's position, ...).
        cause = str(exc.__cause__ or "")
        reason = f": {cause}" if cause and cause not in str(exc) else ""
        raise SystemExit(f"error: {exc}{reason}") from None


def _yaml_as_init(model: type[BaseSettings], values: dict) -> dict:
    """YAML values go in as init kwargs, which pydantic-settings ranks above the
    environment; drop those the environment sets so that env > YAML holds."""
    unknown = set(values) - set(model.model_fields)
    if unknown:
        raise SystemExit(f"error: unknown field(s) in config file: {', '.join(sorted(unknown))}")
    prefix = str(model.model_config.get("env_prefix", "")).upper()
    env = {k.upper() for k in os.environ}
    return {k: v for k, v in values.items() if f"{prefix}{k.upper()}" not in env}
