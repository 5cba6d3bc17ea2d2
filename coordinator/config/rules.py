"""The vocabulary of config validation, public to built-in platforms and plug-ins alike.

A config section is a frozen, kw_only dataclass. What a field accepts beyond its type
hint is a `Rule` in its metadata (`field(default=1, metadata=POSITIVE_INT)`), and checks
that span fields live in a `_finalize(cls, values, given, names) -> Issues` classmethod
on the dataclass. `configwalk.Walker` reads both; this module holds the rules, the
parsers behind them and the errors they raise.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BIND_ADDRESS",
    "CHECKPOINT_URL",
    "DIAL_ADDRESS",
    "DIAL_HOST",
    "DURATION_TEXT",
    "ENV",
    "GPU_INDICES",
    "IMPORT_PATH",
    "NON_EMPTY_STR",
    "NON_NEGATIVE_INT",
    "PORT",
    "POSITIVE_DURATION",
    "POSITIVE_INT",
    "POSITIVE_NUMBER",
    "SECRET",
    "SIZE",
    "SIZE_TEXT",
    "ConfigError",
    "ConfigIssue",
    "Issues",
    "Rule",
    "exists",
    "is_dir",
    "join_path",
    "not_both",
    "parse_duration",
    "parse_size",
    "rule",
    "show",
    "split_address",
    "to_camel",
    "to_snake",
]

@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: where (`trainingService.environmentCount`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """An invalid config; `issues` holds every problem found, not just the first."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))


def show(value: object) -> str:
    """A value as the user wrote it, short enough for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if not isinstance(value, (str, int, float, list, tuple)):
        return f"a {type(value).__name__}"
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


DURATION_TEXT = "a number of seconds or a string like '90s', '30m', '1.5h', '2d'"
_DURATION_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
_DURATION_UNITS = {
    **dict.fromkeys(["", "s", "sec", "secs", "second", "seconds"], 1),
    **dict.fromkeys(["m", "min", "mins", "minute", "minutes"], 60),
    **dict.fromkeys(["h", "hr", "hrs", "hour", "hours"], 3600),
    **dict.fromkeys(["d", "day", "days"], 86400),
}


def parse_duration(value: object) -> float:
    """Seconds in `value`: a number of seconds, or a string like "90s", "30m", "1.5h", "2d".

    Raises ValueError, naming the accepted forms, for anything else (booleans, negative
    or non-finite numbers, unknown units).
    """
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = None
    elif isinstance(value, str):
        match = _DURATION_RE.fullmatch(value)
        if match and match.group(2).lower() in _DURATION_UNITS:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration ({DURATION_TEXT}), got {show(value)}")
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tb": 1000**4, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")
SIZE_TEXT = "bytes as a number, or a string like '512MiB', '8GB', '16GiB'"


def parse_size(value: object) -> int:
    """Bytes in `value`: a number of bytes or a string with a unit ("8GiB", "500MB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"expected a size ({SIZE_TEXT}), got {show(value)}")


_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def split_address(address: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """(host, port) of "host:port"; an IPv6 host is written in brackets, "[::1]:50051".

    The host comes back without brackets. Raises ValueError saying what is wrong.
    """
    low = 0 if allow_port_zero else 1
    shape = f"expected host:port with a port {low}-65535, got {address!r}"
    bracketed = re.fullmatch(r"\[([^\]]*)\]:([0-9]{1,5})", address)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"invalid IPv6 address [{host}] in {address!r}") from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not re.fullmatch(r"[0-9]{1,5}", port_text):
            raise ValueError(shape)
        if ":" in host:
            raise ValueError(f"write an IPv6 host in brackets, like '[::1]:50051'; got {address!r}")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"invalid IPv4 address {host!r} in {address!r}") from None
        elif not _HOSTNAME_RE.fullmatch(host):
            raise ValueError(f"invalid host name {host!r} in {address!r}")
    port = int(port_text)
    if not low <= port <= 65535:
        raise ValueError(shape)
    return host, port


def _bind_address(value: object) -> object:
    if isinstance(value, str):
        split_address(value, allow_port_zero=True)
    return value


def _dial_address(value: object) -> object:
    # Agents dial this address, so "any free port" (0) means nothing here.
    if isinstance(value, str):
        split_address(value, allow_port_zero=False)
    return value


GPU_TEXT = "a list of distinct non-negative GPU indices, or a comma string like '0,1,3'"


def _gpu_indices(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return value
    parts = [part.strip() for part in value.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,6}", part) for part in parts):
        raise ValueError(f"expected {GPU_TEXT}, got {show(value)}")
    return [int(part) for part in parts]


def _valid_env(env: dict[str, str]) -> bool:
    return all(
        name and "=" not in name and "\0" not in name and "\0" not in value
        for name, value in env.items()
    )


@dataclass(frozen=True)
class Rule:
    """What a field accepts beyond its type hint.

    `coerce` turns another accepted form into the hinted type (raising ValueError with
    the message to show); `check` is tried on the converted value; `expect` describes a
    valid value in messages.
    """

    expect: str | None = None
    check: Callable[[Any], bool] | None = None
    coerce: Callable[[Any], Any] | None = None


def rule(
    expect: str,
    check: Callable[[Any], bool] | None = None,
    coerce: Callable[[Any], Any] | None = None,
) -> dict[str, Rule]:
    """Field metadata holding a Rule: `field(default=..., metadata=rule("a port", ok))`."""
    return {"rule": Rule(expect, check, coerce)}


POSITIVE_INT = rule("a positive integer", lambda v: v >= 1)
NON_NEGATIVE_INT = rule("a non-negative integer", lambda v: v >= 0)
NON_EMPTY_STR = rule("a non-empty string", lambda v: bool(v.strip()))
POSITIVE_DURATION = rule(
    f"a positive duration ({DURATION_TEXT})", lambda v: v > 0, coerce=parse_duration
)
SIZE = rule(f"a size ({SIZE_TEXT})", lambda v: v >= 0, coerce=parse_size)
BIND_ADDRESS = rule("host:port (port 0 = any free port)", coerce=_bind_address)
DIAL_ADDRESS = rule("host:port", coerce=_dial_address)
GPU_INDICES = rule(
    GPU_TEXT, lambda v: all(i >= 0 for i in v) and len(set(v)) == len(v), coerce=_gpu_indices
)
IMPORT_PATH = rule(
    "an import path like 'my_package.tuners:MyTuner' or 'my_package.tuners.MyTuner'",
    lambda v: re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*", v) is not None,
)
CHECKPOINT_URL = rule(
    "an object storage URL like s3://bucket/prefix",
    lambda v: re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?", v) is not None,
)
ENV = rule("a mapping of environment variable names (without '=') to strings", _valid_env)

#: What a `_finalize` hook returns: (field path, message) pairs, the path as the field's
#: snake_case name (`machine_list[1]`); the walker spells it as the user did.
Issues = list[tuple[str, str]]


def not_both(given: set[str], names: dict[str, str], first: str, second: str, *, at: str | None = None) -> Issues:
    """For a `_finalize` hook: the issue, reported at `at` (default `second`), when the
    user gave both of two fields that exclude each other."""
    if first in given and second in given:
        return [(at or second, f"give either {names[first]} or {names[second]}, not both")]
    return []


def _secret_text(value: object) -> object:
    # A number where a password belongs is refused without showing it: YAML reads an
    # unquoted 0123 as 123, and error messages must never echo a secret.
    if isinstance(value, str) or value is None:
        return value
    raise ValueError("expected a string (quote it in YAML); the value is not shown")


def _dial_host(value: object) -> object:
    """`host` or `host:port`; the port, when left out, is the one the coordinator binds."""
    if not isinstance(value, str):
        return value
    try:
        split_address(value, allow_port_zero=False)
        return value
    except ValueError as with_port:
        try:
            ipaddress.IPv6Address(value)
            return value
        except ValueError:
            pass
        try:
            split_address(f"{value}:1")
        except ValueError:
            raise with_port from None
    return value


SECRET = rule("a string", coerce=_secret_text)
PORT = rule("a port number 1-65535", lambda v: 1 <= v <= 65535)
DIAL_HOST = rule("host or host:port", coerce=_dial_host)
POSITIVE_NUMBER = rule("a positive number", lambda v: v > 0)


def to_snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False
