"""Wire format of the RPC layer: typed messages, and dataclass ↔ wire conversion.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of msgpack
(bytes stay bytes, str stays str; no pickle, no ext types), encoded and decoded by msgspec
(compiled; the same msgpack any other reader sees).

* request:  ``{"i": int id, "m": str method, "p": params}``
* response: ``{"i": id, "r": result}`` or ``{"i": id, "e": {"c": code, "s": message, "d": data}}``
* one-way notice (no response): ``{"m": str method, "p": params}`` (no ``"i"``)

Typed messages are ``Message`` subclasses (``msgspec.Struct``): a map of their fields on
the wire, checked field by field as they are decoded (``decode_as``: a wrong type, a
missing or an unknown field is a ``ValueError`` naming the field). Plain dataclasses still
travel as maps (``to_wire`` / ``from_wire``) on the cold paths that use them.

Frames over ``MAX_FRAME_BYTES`` are refused (``MALFORMED_FRAME``) and the connection is
closed, since the stream cannot be resynchronised.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from typing import Any

import msgpack
import msgspec

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest frame either end accepts (bytes). Bulk data goes through the Transfer Engine."""

HEADER = struct.Struct(">I")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True,
              gc=False):
    """Base of the typed RPC messages: immutable, a map of its fields on the wire (fields
    at their default left out), decoded with every field's type checked and unknown fields
    refused. ``__post_init__`` checks (cross-field rules) run on decode as well."""


class Request(msgspec.Struct, gc=False):
    """A request frame as the server decodes it: the params stay raw msgpack until the
    method, and with it the params' type, is known."""

    m: str
    i: int | None = None
    p: msgspec.Raw = msgspec.Raw()


class Reply(msgspec.Struct, gc=False):
    """A response frame as the client decodes it (the result stays raw msgpack until the
    caller's type decodes it)."""

    i: int | None = None
    r: msgspec.Raw = msgspec.Raw()
    e: Any = None


NIL = b"\xc0"
"""msgpack's nil: the params of a request that sent none."""


def _enc_hook(obj: Any) -> Any:
    raise TypeError(f"cannot send {type(obj).__name__} over RPC; use plain data, a "
                    "Message or a dataclass")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_ANY = msgspec.msgpack.Decoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(obj: Any) -> bytes:
    """msgpack of ``obj``: ``Message``s and dataclasses become maps of their fields, tuples
    and sets lists. Raises ``TypeError`` for what cannot travel."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, OverflowError):  # e.g. a map keyed by tuples: msgpack's own packer
        return msgpack.packb(obj, use_bin_type=True, default=_default)


def pack_frame(obj: Any) -> bytes:
    """msgpack ``obj`` and prefix its length. Raises ``ValueError`` if over the limit."""
    body = encode(obj)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | memoryview) -> Any:
    """Decode one frame body (raises ``ValueError`` on malformed msgpack)."""
    try:
        return _ANY.decode(body)
    except msgspec.DecodeError:
        pass
    try:  # msgpack's reader for what msgspec refuses (and for the words of the error)
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several exception types for bad input
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, msgpack.FormatError) and not str(e):
            why += " (a byte that begins no msgpack value)"
        raise ValueError(f"malformed msgpack frame of {len(body)} bytes, starting "
                         f"{bytes(body[:8]).hex(' ')}: {why}") from e


def decoder(tp: Any) -> msgspec.msgpack.Decoder:
    """The (cached) compiled decoder of type ``tp``."""
    dec = _DECODERS.get(tp)
    if dec is None:
        dec = _DECODERS[tp] = msgspec.msgpack.Decoder(tp)
    return dec


def field_error(e: msgspec.DecodeError, where: str) -> str:
    """msgspec's ``... - at `$.a[0].b``` as ``where.a[0].b: ...`` (the field first)."""
    msg = str(e)
    head, sep, path = msg.rpartition(" - at `$")
    if sep:
        return f"{where}{path.rstrip('`')}: {head}"
    return f"{where}: {msg}"


def decode_as(tp: Any, data: bytes | memoryview | msgspec.Raw, where: str | None = None) -> Any:
    """Decode msgpack ``data`` as ``tp`` (a ``Message``, a dataclass or any type msgspec
    knows), checking every field; ``ValueError`` naming the field on a mismatch."""
    try:
        return decoder(tp).decode(data if len(data) else NIL)
    except msgspec.DecodeError as e:
        raise ValueError(field_error(e, where or getattr(tp, "__name__", str(tp)))) from None


def _default(obj: Any) -> Any:
    if isinstance(obj, msgspec.Struct):
        return msgspec.to_builtins(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_wire(obj)
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    if isinstance(obj, memoryview):
        return obj.tobytes()
    raise TypeError(f"cannot send {type(obj).__name__} over RPC; use plain data, a Message "
                    "or a dataclass")


def to_wire(obj: Any) -> Any:
    """Dataclasses and ``Message``s → dicts of their fields (recursively), tuples → lists;
    else unchanged."""
    if isinstance(obj, msgspec.Struct):
        return msgspec.to_builtins(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj


_SCALARS = (int, float, str, bytes, bool, type(None))


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against the type ``hint`` and convert lists/dicts to the hinted type."""
    if hint is Any or hint is object:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for alt in args:
            try:
                return _convert(value, alt, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{where}: {value!r} matches none of {hint}")
    if hint is type(None) or hint is None:
        if value is not None:
            raise ValueError(f"{where}: expected None, got {type(value).__name__}")
        return None
    if dataclasses.is_dataclass(hint):
        return from_wire(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]")
                     for i, (v, a) in enumerate(zip(value, args, strict=False)))
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(v, args[0], f"{where}[{i}]") if args else v for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
        if not args:
            return value
        return {_convert(k, args[0], f"{where} key"): _convert(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()}
    if isinstance(hint, type) and hint in _SCALARS:
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if hint is int and isinstance(value, bool):
            raise ValueError(f"{where}: expected int, got bool")
        if not isinstance(value, hint):
            raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    if isinstance(hint, type) and issubclass(hint, str | int) and isinstance(value, str | int):
        return hint(value)  # enums and NewType-like str/int subclasses
    if getattr(hint, "__supertype__", None) is not None:  # typing.NewType
        return _convert(value, hint.__supertype__, where)
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def from_wire(cls: type, data: Any, where: str | None = None) -> Any:
    """Build the dataclass ``cls`` from a wire map, checking field names and types.

    Raises ``ValueError`` naming the field for: a non-map, an unknown field, a missing
    required field, or a value of the wrong type. ``cls.__post_init__`` validation runs
    as usual.
    """
    where = where or cls.__name__
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(field_error(e, where)) from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a map, got {type(data).__name__}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints.get(f.name, Any), f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}: missing field {f.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
