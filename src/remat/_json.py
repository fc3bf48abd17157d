"""Reading and writing remat's JSON files (profile, plan, measure, timeline, bench ...) with errors a user can act on.

# NOTE [ One loading policy ]
Every kind of file remat writes is a frozen dataclass turned into a JSON object with a
``schema_version``, and every ``from_json`` reads it back through :func:`read` (or :func:`load` and
:meth:`Reader.build`), so all kinds fail the same way:

- text that is not JSON, not an object, or of another ``schema_version``: a :class:`RematError`;
- a field of the dataclass without a default that the file lacks: a :class:`RematError` naming the
  field (with its path, e.g. ``blocks[2].fqns``); a field with a default takes the default, so files
  written before a field was added still load; a top-level object lacking most required fields is
  taken for another kind of file, and the message lists the keys it has instead;
- a value of the wrong type (checked against the dataclass's annotations, nested dataclasses,
  Enums, NamedTuples, tuples and dicts included): a :class:`RematError` naming the field, the value
  and what was expected;
- a key the dataclass does not have: ignored, with one logged warning per object naming the keys
  (and the closest field, to catch typos in hand-edited files). Ignoring rather than refusing lets a
  file written by a newer remat that only *added* fields be read by this one; a change that older
  readers must not misread bumps ``schema_version`` instead, which is refused.

Every message reads ``"<kind> json: <what is wrong>; <how to fix it>"``. Files are written with
:func:`write_atomic`, so a reader never sees half a file and a failed write leaves the old file.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import logging
import os
import secrets
import stat
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, Union

from remat.errors import RematError

__all__ = ["Reader", "load", "read", "write_atomic"]

log = logging.getLogger(__name__)

T = TypeVar("T")

Converter = Callable[["Reader", Any, str], Any]
"""Reads one field's JSON value itself: ``(reader, value, path) -> value``; raises through ``reader.error``."""

# Keys every top-level object may carry besides the dataclass's fields.
_ENVELOPE = ("schema_version",)


@dataclasses.dataclass(frozen=True)
class Reader:
    """How to read one kind of file: its name in messages and the fix a user should apply.

    Attributes:
        kind: The kind of file, e.g. ``"plan"``; messages start with ``"<kind> json:"``.
        fix: What to do about a bad file, e.g. ``"make it again with `remat plan`"``.
    """

    kind: str
    fix: str = ""

    @property
    def remedy(self) -> str:
        """The fix to suggest: :attr:`fix`, or writing the file again."""
        return self.fix or f"write the {self.kind} file again with this version of remat"

    def error(self, path: str, problem: str) -> RematError:
        """The error for ``problem`` at field ``path`` (``""``: the whole file)."""
        where = f"field {path!r} " if path else ""
        return RematError(f"{self.kind} json: {where}{problem}; {self.remedy}")

    def missing(self, path: str, also: int = 0, others: Sequence[str] = ()) -> RematError:
        """The error for a required field ``path`` that the file lacks.

        For a file of another kind (a profile given for a plan) the top level lacks most required
        fields: ``also`` counts the others it lacks and ``others`` lists the keys it has instead.
        """
        hint = ""
        if others:
            shown = ", ".join(map(repr, others[:5])) + (", ..." if len(others) > 5 else "")
            hint = f" and {also} more of the fields a {self.kind} has (it has {shown} instead: is it another kind of file?)"
        return RematError(f"{self.kind} json: missing field {path!r}{hint}; {self.remedy}")

    def object(self, value: Any, path: str) -> dict[str, Any]:
        """``value`` if it is a JSON object, else the error for ``path``."""
        if not isinstance(value, dict):
            raise self.error(path, f"is {_show(value)}, expected an object")
        return value

    def field(self, data: Mapping[str, Any], name: str, tp: Any, path: str = "") -> Any:
        """Required field ``name`` of object ``data`` (at ``path``), read as type ``tp``."""
        sub = _join(path, name)
        if name not in data:
            raise self.missing(sub)
        return self.value(tp, data[name], sub)

    def value(self, tp: Any, value: Any, path: str) -> Any:
        """``value`` read as type ``tp`` (an annotation), or the error naming ``path``.

        Supports ``Any``, ``None``, ``bool``, ``int``, ``float`` (ints accepted), ``str``, Enums (by value),
        ``X | None`` and other unions (first that fits), ``tuple[X, ...]``, fixed tuples, ``list[X]``,
        ``dict[str, X]``, NamedTuples (a list or an object) and dataclasses (see :meth:`build`).
        """
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return value
        if tp is None or tp is type(None):
            if value is not None:
                raise self.error(path, f"is {_show(value)}, expected null")
            return None
        if origin is Union or origin is types.UnionType:
            if value is None and type(None) in args:
                return None
            options = [a for a in args if a is not type(None)]
            if len(options) == 1:
                return self.value(options[0], value, path)
            for option in options:
                try:
                    return self.value(option, value, path)
                except RematError:
                    continue
            raise self.error(path, f"is {_show(value)}, expected {' or '.join(_expect(a) for a in args)}")
        if tp is bool:
            if not isinstance(value, bool):
                raise self.error(path, f"is {_show(value)}, expected true or false")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.error(path, f"is {_show(value)}, expected an integer")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.error(path, f"is {_show(value)}, expected a number")
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise self.error(path, f"is {_show(value)}, expected a string")
            return value
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            for member in tp:
                if member.value == value and type(member.value) is type(value):
                    return member
            raise self.error(path, f"is {_show(value)}, expected {_expect(tp)}")
        if origin in (tuple, list):
            if not isinstance(value, list):
                raise self.error(path, f"is {_show(value)}, expected {_expect(tp)}")
            if origin is list or (len(args) == 2 and args[1] is Ellipsis) or not args:
                item = args[0] if args else Any
                items = [self.value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
            else:
                if len(value) != len(args):
                    raise self.error(path, f"has {len(value)} entries, expected {len(args)}")
                items = [self.value(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
            return items if origin is list else tuple(items)
        if origin is dict:
            key_tp, item_tp = args or (Any, Any)
            data = self.object(value, path)
            return {
                self.value(key_tp, k, path): self.value(item_tp, v, f"{path}[{json.dumps(k)}]") for k, v in data.items()
            }
        if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
            return self._named_tuple(tp, value, path)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.build(tp, value, path)
        if isinstance(tp, type):
            if not isinstance(value, tp):
                raise self.error(path, f"is {_show(value)}, expected {_expect(tp)}")
            return value
        raise TypeError(f"remat._json cannot read annotation {tp!r} (at {path!r}); give a converter")

    def build(self, cls: type[T], value: Any, path: str = "", convert: Mapping[str, Converter] | None = None) -> T:
        """The dataclass ``cls`` from JSON object ``value`` (NOTE [ One loading policy ]).

        Args:
            cls: A dataclass; its fields and their annotations say what the object must hold.
            value: The JSON object.
            path: Where the object is in the file (``""``: the top level).
            convert: Field name -> converter, for fields whose JSON form is not their annotation.
        """
        data = self.object(value, path)
        hints = _hints(cls)
        convert = convert or {}
        kwargs: dict[str, Any] = {}
        known = set()
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            known.add(f.name)
            sub = _join(path, f.name)
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise self._missing_in(cls, data, sub, path)
                continue
            conv = convert.get(f.name)
            kwargs[f.name] = conv(self, data[f.name], sub) if conv else self.value(hints[f.name], data[f.name], sub)
        self.ignore_unknown(data, known | (set(_ENVELOPE) if not path else set()), path)
        return cls(**kwargs)

    def _missing_in(self, cls: Any, data: Mapping[str, Any], sub: str, path: str) -> RematError:
        # A top-level object lacking most required fields is taken for another kind of file.
        fields = dataclasses.fields(cls)
        required = [
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        lacking = [n for n in required if n not in data]
        names = {f.name for f in fields} | set(_ENVELOPE)
        others = sorted(k for k in data if k not in names)
        if path or 2 * len(lacking) <= len(required) or not others:
            return self.missing(sub)
        return self.missing(sub, len(lacking) - 1, others)

    def _named_tuple(self, tp: type[T], value: Any, path: str) -> T:
        names: tuple[str, ...] = tp._fields  # type: ignore[attr-defined]
        hints = _hints(tp)
        if isinstance(value, dict):
            missing = [n for n in names if n not in value and n not in tp._field_defaults]  # type: ignore[attr-defined]
            if missing:
                raise self.missing(_join(path, missing[0]))
            self.ignore_unknown(value, set(names), path)
            return tp(**{n: self.value(hints[n], value[n], _join(path, n)) for n in names if n in value})
        if not isinstance(value, list) or len(value) != len(names):
            raise self.error(path, f"is {_show(value)}, expected a list of {len(names)} ({', '.join(names)})")
        return tp(*(self.value(hints[n], v, f"{path}[{i}]") for i, (n, v) in enumerate(zip(names, value))))

    def ignore_unknown(self, data: Mapping[str, Any], known: set[str], path: str) -> None:
        """Log one warning naming the keys of ``data`` (at ``path``) that are not in ``known``."""
        extra = sorted(k for k in data if k not in known)
        if not extra:
            return
        hints = []
        for k in extra:
            close = difflib.get_close_matches(str(k), sorted(known - set(_ENVELOPE)), n=1)
            hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
        where = f" in {path!r}" if path else ""
        log.warning(
            "%s json: ignoring unknown field%s %s%s; a newer remat may have written %s, or %s a typo",
            self.kind,
            "s" if len(extra) > 1 else "",
            ", ".join(hints),
            where,
            *(("them", "they are") if len(extra) > 1 else ("it", "it is")),
        )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _hints(cls: Any) -> dict[str, Any]:
    return _cached_hints(cls)


@functools.cache
def _cached_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _show(value: Any) -> str:
    """A short description of a JSON value for a message."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expect(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, for a message."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(json.dumps(m.value) for m in tp)
    if typing.get_origin(tp) in (tuple, list):
        return "a list"
    if typing.get_origin(tp) is dict or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return "an object"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _refuse_a_path(text: Any, kind: str) -> None:
    """A RematError with the fix where ``from_json`` was given a file's name, a ``Path`` or a parsed object
    instead of the file's text (``Plan.from_json("plan.json")``): json's own message says neither."""
    named = isinstance(text, os.PathLike) or (
        isinstance(text, str) and text.strip().endswith(".json") and not text.lstrip().startswith("{")
    )
    if named:
        raise RematError(
            f"{kind} json: got the file name {str(text)!r}, not the file's text; read it first: "
            f"from_json(Path({str(text)!r}).read_text())"
        )
    if not isinstance(text, (str, bytes, bytearray)):
        raise RematError(
            f"{kind} json: got {type(text).__name__}, not the file's text; pass the text a to_json() wrote "
            "(for a dict: json.dumps(d))"
        )


def load(text: str, what: str | Reader, schema_version: int) -> dict[str, Any]:
    """Parse ``text`` as the JSON object of a ``what`` file with ``schema_version``.

    Args:
        text: The file's text.
        what: The kind of file (``"plan"``), or its :class:`Reader`.
        schema_version: The version this remat writes; any other is refused.

    Returns:
        The object, ``schema_version`` included.

    Raises:
        RematError: If the text is a file name or not text, not JSON, not an object, or of another schema
            version.
    """
    reader = what if isinstance(what, Reader) else Reader(what)
    _refuse_a_path(text, reader.kind)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RematError(
            f"{reader.kind} json: not valid JSON ({e.msg} at line {e.lineno}); give a file written by remat"
        ) from None
    except RecursionError:
        raise RematError(f"{reader.kind} json: nested too deeply to read; give a file written by remat") from None
    if not isinstance(data, dict):
        raise RematError(
            f"{reader.kind} json: the file holds {_show(data)}, not an object; give a file written by remat"
        )
    found = data.get("schema_version")
    if found != schema_version or isinstance(found, bool):
        raise RematError(f"{reader.kind} json: schema_version {found!r} is not {schema_version}; {reader.remedy}")
    return data


def read(cls: type[T], text: str, what: str | Reader, *, convert: Mapping[str, Converter] | None = None) -> T:
    """``cls`` (a dataclass with a ``schema_version`` class variable) from the text of its JSON file.

    Args:
        cls: The dataclass, e.g. ``Measurement``.
        text: The file's text.
        what: The kind of file, or its :class:`Reader` (with the fix to suggest).
        convert: Field name -> converter, for fields whose JSON form is not their annotation.

    Raises:
        RematError: As in NOTE [ One loading policy ].
    """
    reader = what if isinstance(what, Reader) else Reader(what)
    data = load(text, reader, cls.schema_version)  # type: ignore[attr-defined]
    return reader.build(cls, data, "", convert)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: readers see the old file or the new one, never a part.

    The text goes to a temporary file in the same folder, which then replaces ``path`` with
    ``os.replace``; a symlink is written through to its target, an existing file keeps its
    permissions. On failure the temporary file is removed and ``path`` is left as it was. A path that
    is not a regular file (``/dev/stdout``, a pipe) is written to directly.

    Raises:
        OSError: If the folder does not exist or is not writable.
    """
    target = os.path.realpath(os.fspath(path))
    try:
        mode: int | None = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None  # a new file: the umask decides its mode, as for open(path, "w")
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # "x": never reuse someone else's file
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
