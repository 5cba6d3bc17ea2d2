"""The walker: turns plain data (as YAML loads it) into config dataclasses.

It reads each field's type hint and the `configrules.Rule` in its metadata, calls each
dataclass's `_finalize` hook, and collects every problem, each with the path of the key
as the user spelled it, instead of stopping at the first. A base class registered with
`register_variants` is parsed as one of its subclasses, picked by a tag key
(`trainingService.platform`), from a mapping that may import the subclass only then.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from .rules import ConfigIssue, Issues, Rule, join_path, show, to_camel, to_snake

__all__ = ["INVALID", "VARIANTS", "Spec", "Walker", "check_supported", "plain_data", "register_variants", "specs"]

#: Dataclass types parsed as one of several subclasses: base -> (tag key, tag -> subclass).
#: The mapping's keys name every choice; looking one up may import it, and raises
#: ImportError (with the reason) when it cannot be loaded.
VARIANTS: dict[type, tuple[str, Mapping[str, type]]] = {}


#: Variants that may also be written as a list: base -> (tag, key). A list is read as
#: `{tag_key: tag, key: the list}` (NNI's `trainingService: [...]` is `platform: hybrid`).
LIST_FORMS: dict[type, tuple[str, str]] = {}


def register_variants(
    base: type, tag_key: str, choices: Mapping[str, type], *, list_form: tuple[str, str] | None = None
) -> None:
    """Parse fields typed `base` as `choices[data[tag_key]]` (and a list as `list_form`)."""
    VARIANTS[base] = (tag_key, choices)
    if list_form is not None:
        LIST_FORMS[base] = list_form


INVALID: Any = object()  # a value that failed validation; its issues are already recorded
_NONE_TYPE = type(None)


@dataclass(frozen=True)
class Spec:
    name: str
    camel: str
    type: Any
    rule: Rule | None
    default: Any  # dataclasses.MISSING when the key is required
    factory: Any


@functools.cache
def specs(cls: type) -> tuple[Spec, ...]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        check_supported(hints[f.name], f"{cls.__qualname__}.{f.name}")
        found.append(
            Spec(
                f.name,
                to_camel(f.name),
                hints[f.name],
                f.metadata.get("rule"),
                f.default,
                f.default_factory,
            )
        )
    return tuple(found)


def check_supported(tp: Any, where: str) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not _NONE_TYPE]
        if len(inner) != 1:
            raise TypeError(f"{where}: only Optional[X] unions are supported, not {tp}")
        check_supported(inner[0], where)
    elif origin is list:
        check_supported(args[0] if args else Any, where)
    elif origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: mapping keys must be str, not {args[0]}")
        check_supported(args[1] if args else Any, where)
    elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
        for spec in specs(tp):
            check_supported(spec.type, f"{where}.{spec.name}")
    elif not (
        tp in (Any, str, int, float, bool, Path, list, dict)
        or origin is Literal
        or (isinstance(tp, type) and issubclass(tp, enum.Enum))
    ):
        raise TypeError(f"{where}: unsupported config field type {tp!r}")


def describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return describe(next(a for a in args if a is not _NONE_TYPE))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp in VARIANTS:
        tag, registry = VARIANTS[tp]
        one = f"a mapping with '{tag}' (one of: {', '.join(registry)})"
        return f"{one}, or a list of such mappings" if tp in LIST_FORMS else one
    simple = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
        list: "a list",
        Any: "any value",
    }
    if origin is list:
        return "a list"
    return simple.get(tp) or "a mapping"



def _style(data: Mapping[Any, Any], inherited: str) -> str:
    """The key spelling a mapping uses, to name keys the user did not write."""
    keys = [k for k in data if isinstance(k, str)]
    if any(c.isupper() for k in keys for c in k):
        return "camel"
    if any("_" in k for k in keys):
        return "snake"
    return inherited


def _unknown_key(key: str, names: list[str]) -> str:
    spell = (lambda n: n) if "_" in key else to_camel
    match = difflib.get_close_matches(to_snake(key), names, n=1, cutoff=0.6)
    if match:
        return f"unknown key; did you mean '{spell(match[0])}'?"
    return "unknown key; valid keys are: " + ", ".join(spell(n) for n in names)


class Walker:
    """Converts plain data to config dataclasses, recording every problem on the way."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.issues: list[ConfigIssue] = []
        self.style = "camel"

    def report(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, message))

    def field_value(self, spec: Spec, value: Any, path: str) -> Any:
        rule, given = spec.rule, value
        if rule and rule.coerce and value is not None:
            try:
                value = rule.coerce(value)
            except ValueError as e:
                self.report(path, str(e))
                return INVALID
        result = self.convert(spec.type, value, path, rule.expect if rule else None)
        if result is None or result is INVALID or rule is None or rule.check is None:
            return result
        if not rule.check(result):
            self.report(path, f"expected {rule.expect}, got {show(given)}")
            return INVALID
        return result

    def convert(self, tp: Any, value: Any, path: str, expect: str | None = None) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)

        def bad(hint: str = "") -> Any:
            self.report(path, f"expected {expect or describe(tp)}, got {show(value)}{hint}")
            return INVALID

        if origin in (Union, types.UnionType):
            if value is None and _NONE_TYPE in args:
                return None
            inner = next(a for a in args if a is not _NONE_TYPE)
            return self.convert(inner, value, path, expect)
        if tp is Any:
            problems: Issues = []
            plain = plain_data(value, path, problems)
            for where, message in problems:
                self.report(where, message)
            return INVALID if problems else plain
        if value is None:
            return bad()
        if origin is Literal:
            choices = [a for a in args if type(a) is type(value) and a == value]
            return choices[0] if choices else bad()
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            members = [m for m in tp if type(m.value) is type(value) and m.value == value]
            return members[0] if members else bad()
        if tp in VARIANTS:
            return self.variant(tp, value, path)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin is list or tp is list:
            if not isinstance(value, list):
                return bad()
            elem = args[0] if args else Any
            items = [self.convert(elem, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return INVALID if any(i is INVALID for i in items) else items
        if origin is dict or tp is dict:
            if not isinstance(value, Mapping):
                return bad()
            return self.mapping(args[1] if args else Any, value, path)
        if tp is bool:
            return value if isinstance(value, bool) else bad()
        if tp is int:
            return value if isinstance(value, int) and not isinstance(value, bool) else bad()
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:
                    return bad()
                return number if math.isfinite(number) else bad()
            return bad()
        if tp is str:
            if isinstance(value, str):
                return value
            scalar = isinstance(value, (int, float, bool))
            return bad(" (quote it in YAML to make it a string)" if scalar else "")
        if tp is Path:
            return self.path(value, path, bad)
        raise TypeError(f"unsupported config field type {tp!r}")  # check_supported missed it

    def mapping(self, value_type: Any, value: Mapping[Any, Any], path: str) -> Any:
        result: dict[str, Any] = {}
        failed = False
        for key, item in value.items():
            if not isinstance(key, str):
                self.report(join_path(path, show(key)), f"keys must be strings, got {show(key)}")
                failed = True
                continue
            result[key] = self.convert(value_type, item, join_path(path, key))
            failed = failed or result[key] is INVALID
        return INVALID if failed else result

    def path(self, value: Any, path: str, bad: Callable[[], Any]) -> Any:
        if isinstance(value, str) and value.strip() and "\0" not in value:
            raw = Path(value)
        elif isinstance(value, Path):
            raw = value
        else:
            return bad()
        try:
            raw = raw.expanduser()
        except RuntimeError:
            self.report(path, f"cannot expand '~' in {value!r}: no such user")
            return INVALID
        return Path(os.path.normpath(self.base_dir / raw))

    def variant(self, base: type, value: Any, path: str) -> Any:
        tag_key, registry = VARIANTS[base]
        if isinstance(value, list) and base in LIST_FORMS:
            return self._list_form(base, value, path)
        if not isinstance(value, Mapping):
            self.report(path, f"expected {describe(base)}, got {show(value)}")
            return INVALID
        tag = value.get(tag_key)
        valid = ", ".join(registry)
        if tag is None:
            self.report(join_path(path, tag_key), f"required key is missing (one of: {valid})")
            return INVALID
        if not isinstance(tag, str):
            self.report(join_path(path, tag_key), f"expected one of: {valid}, got {show(tag)}")
            return INVALID
        if tag not in registry:
            close = difflib.get_close_matches(tag, list(registry), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            self.report(join_path(path, tag_key), f"unknown {tag_key} {tag!r}; {hint}valid: {valid}")
            return INVALID
        try:
            chosen = registry[tag]
        except ImportError as e:  # a plug-in that is installed but broken; e names it
            self.report(join_path(path, tag_key), str(e))
            return INVALID
        return self.dataclass(chosen, value, path, extra_keys=(tag_key,))

    def _list_form(self, base: type, value: list[Any], path: str) -> Any:
        tag_key, _ = VARIANTS[base]
        tag, key = LIST_FORMS[base]
        first = len(self.issues)
        result = self.variant(base, {tag_key: tag, key: value}, path)
        # The user wrote the list itself: its problems are located in it, not under `key`.
        inner = join_path(path, key)
        self.issues[first:] = [
            ConfigIssue(path + issue.path[len(inner):], issue.message)
            if issue.path == inner or issue.path.startswith((inner + "[", inner + "."))
            else issue
            for issue in self.issues[first:]
        ]
        return result

    def dataclass(self, cls: type, data: Any, path: str, extra_keys: tuple[str, ...] = ()) -> Any:
        if not isinstance(data, Mapping):
            self.report(path, f"expected a mapping, got {show(data)}")
            return INVALID
        fields = specs(cls)
        by_key = {s.name: s for s in fields} | {s.camel: s for s in fields}
        # As NNI does, keys match in any case, with or without underscores.
        by_key |= {s.name.replace("_", ""): s for s in fields if s.name.replace("_", "") not in by_key}
        outer_style, self.style = self.style, _style(data, self.style)
        try:
            failed, values, given, spelled = self._fields(fields, by_key, data, path, extra_keys)
            names = {
                s.name: spelled.get(s.name, s.name if self.style == "snake" else s.camel)
                for s in fields
            }
        finally:
            self.style = outer_style
        for spec in fields:
            if spec.name in given:
                continue
            if spec.default is not dataclasses.MISSING:
                values[spec.name] = self._default(spec.default)
            elif spec.factory is not dataclasses.MISSING:
                values[spec.name] = self._default(spec.factory())
            else:
                expect = (
                    spec.rule.expect if spec.rule and spec.rule.expect else describe(spec.type)
                )
                self.report(join_path(path, names[spec.name]), f"required key is missing ({expect})")
                failed = True
        finalize = getattr(cls, "_finalize", None)
        for where, message in finalize(values, given, names) if finalize else ():
            head = re.split(r"[.\[]", where, maxsplit=1)[0]
            self.report(join_path(path, names.get(head, head) + where[len(head) :]), message)
            failed = True
        if failed:
            return INVALID
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            self.report(path, str(e))
            return INVALID

    def _fields(
        self,
        fields: tuple[Spec, ...],
        by_key: dict[str, Spec],
        data: Mapping[Any, Any],
        path: str,
        extra_keys: tuple[str, ...],
    ) -> tuple[bool, dict[str, Any], set[str], dict[str, str]]:
        failed = False
        values: dict[str, Any] = {}
        given: set[str] = set()
        spelled: dict[str, str] = {}
        for key, raw in data.items():
            if not isinstance(key, str):
                self.report(join_path(path, show(key)), f"keys must be strings, got {show(key)}")
                failed = True
                continue
            if key in extra_keys:
                continue
            spec = by_key.get(key) or by_key.get(key.lower().replace("_", ""))
            if spec is None:
                candidates = [s.name for s in fields] + list(extra_keys)
                self.report(join_path(path, key), _unknown_key(key, candidates))
                failed = True
                continue
            if spec.name in spelled:
                self.report(
                    join_path(path, key), f"the same key as '{spelled[spec.name]}'; give it once"
                )
                failed = True
                continue
            spelled[spec.name] = key
            has_default = not (spec.default is spec.factory is dataclasses.MISSING)
            if raw is None and has_default:
                continue  # an empty YAML value means "the default"
            given.add(spec.name)
            value = self.field_value(spec, raw, join_path(path, key))
            if value is INVALID:
                failed = True
            else:
                values[spec.name] = value
        return failed, values, given, spelled

    def _default(self, value: Any) -> Any:
        # Relative default paths (trial_code_directory = ".") are relative to the config.
        return Path(os.path.normpath(self.base_dir / value)) if isinstance(value, Path) else value



def plain_data(value: Any, path: str, problems: Issues, ancestors: tuple[int, ...] = ()) -> Any:
    """A copy of JSON-like data, so that the stored config can always be serialised."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, Mapping)) and id(value) in ancestors:
        problems.append((path, "a structure that contains itself"))
        return None
    inner = (*ancestors, id(value))
    if isinstance(value, (list, tuple)):
        return [plain_data(v, f"{path}[{i}]", problems, inner) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            if isinstance(key, str):
                result[key] = plain_data(item, join_path(path, key), problems, inner)
            else:
                problems.append(
                    (join_path(path, show(key)), f"keys must be strings, got {show(key)}")
                )
        return result
    problems.append(
        (
            path,
            f"expected plain data (mappings, lists, strings, numbers, booleans), got {show(value)}",
        )
    )
    return None

