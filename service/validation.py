"""Turn untrusted request input into domain values, or say exactly what is wrong."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multidict import MultiMapping

NAMA_MAX = 200
HARGA_MAX = 10**12
PAGE_DEFAULT = 50
PAGE_MAX = 200
# SQLite and PostgreSQL integers are 64-bit; larger ids cannot exist.
ID_MAX = 2**63 - 1
# Far more than harga takes, far fewer than int()'s 4300: a longer integer in a
# body is refused as such, not echoed back or left to int()'s own message.
JSON_INT_DIGITS_MAX = 40
PRODUCT_FIELDS = frozenset({"nama", "harga"})
# What of the client's own input an error message repeats: a path or a header
# may be 8 KB, and a message that long is not read.
ECHO_MAX = 100
# Control characters (C0, DEL, C1), the line and paragraph separators, and
# lone surrogates (what a stray \uD800 escape decodes to): none belongs in a
# one-line name, an email subject or a shop page.
_FORBIDDEN_IN_NAMA = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# What is trimmed from nama: exactly what \s in the OpenAPI document's pattern
# means to a client validating in JavaScript (ECMA-262 WhiteSpace and
# LineTerminator: the Zs spaces, TAB, VT, FF, LF, CR, U+2028/9 and U+FEFF).
# Plain str.strip() keeps U+FEFF, so a nama of nothing else was stored, and
# trims U+001C-U+001F and U+0085, which the document refuses as control characters.
NAMA_BLANKS = (
    "\t\n\v\f\r \xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)


class InvalidInput(ValueError):
    """The client sent something we cannot accept (HTTP 400)."""


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _LongInteger(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Named because clients do send charset=latin-1 and expect it to count.
        raise InvalidInput(
            f"body is not valid UTF-8 (byte {exc.start}); JSON is always UTF-8 (RFC 8259), "
            "whatever the Content-Type's charset says"
        ) from None
    if not text.strip():
        raise InvalidInput("body is empty; send a JSON object")
    if text.startswith("\ufeff"):
        raise InvalidInput("body starts with a byte order mark; send JSON without one")
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(
            f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except _RepeatedKey as exc:
        raise InvalidInput(
            f"field {shortened(exc.key)!r} is given twice; send each field once"
        ) from None
    except _LongInteger as exc:
        # harga is the only number a product has.
        raise InvalidInput(
            f"field 'harga' must be an integer from 0 to {HARGA_MAX}; "
            f"the body has one of {exc.digits} digits"
        ) from None
    except ValueError as exc:  # NaN, Infinity
        raise InvalidInput(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("body is nested too deeply to be a product") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"body must be a JSON object, not {_json_type(value)}")
    return value


def _reject_constant(name: str) -> Any:
    # A plain ValueError: parse_json_object adds the "not valid JSON" prefix.
    raise ValueError(f"{name} is not a JSON number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # JSON leaves a repeated name to the parser (RFC 8259, 4): json keeps the
    # last, another reader of the same body (a proxy, a log) may take the
    # first. Refused, as a header or query parameter given twice is.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return obj


def shortened(text: str) -> str:
    """``text`` as an error message repeats it: whole when short, else its start."""
    if len(text) <= ECHO_MAX:
        return text
    return f"{text[: ECHO_MAX // 2]}... ({len(text)} characters)"


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > JSON_INT_DIGITS_MAX:
        raise _LongInteger(digits)
    return int(text)


# One decoder for every request: json.loads with options builds a new one each call.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_object, parse_constant=_reject_constant, parse_int=_parse_int
)


def validate_new_product(data: Mapping[str, Any]) -> tuple[str, int]:
    unknown = sorted(set(data) - PRODUCT_FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(unknown)}; allowed: harga, nama")
    return _nama(data), _harga(data)


def validate_product_change(data: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(nama, harga) of a PATCH body, None for a field it leaves as it is;
    each field given is held to the rules of a new product's."""
    unknown = sorted(set(data) - PRODUCT_FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(unknown)}; allowed: harga, nama")
    if not data:
        raise InvalidInput("body changes nothing; send nama, harga or both")
    nama = _nama(data) if "nama" in data else None
    harga = _harga(data) if "harga" in data else None
    return nama, harga


def _nama(data: Mapping[str, Any]) -> str:
    if "nama" not in data:
        raise InvalidInput("field 'nama' is required")
    nama = data["nama"]
    if not isinstance(nama, str):
        raise InvalidInput(f"field 'nama' must be a string, not {_json_type(nama)}")
    nama = nama.strip(NAMA_BLANKS)
    if not nama:
        raise InvalidInput("field 'nama' must not be empty")
    if len(nama) > NAMA_MAX:
        raise InvalidInput(f"field 'nama' must be at most {NAMA_MAX} characters, got {len(nama)}")
    if _FORBIDDEN_IN_NAMA.search(nama):
        raise InvalidInput("field 'nama' must not contain control characters or line breaks")
    return nama


def _harga(data: Mapping[str, Any]) -> int:
    if "harga" not in data:
        raise InvalidInput("field 'harga' is required")
    harga = data["harga"]
    # bool is a subclass of int in Python; JSON true is not a price.
    if isinstance(harga, bool) or not isinstance(harga, int):
        raise InvalidInput(f"field 'harga' must be an integer, not {_json_type(harga)}")
    if not 0 <= harga <= HARGA_MAX:
        raise InvalidInput(f"field 'harga' must be between 0 and {HARGA_MAX}, got {harga}")
    return harga


_IDEMPOTENCY_KEY = re.compile(r"[\x20-\x7e]{1,255}")


def idempotency_key(values: Sequence[str]) -> str | None:
    """The Idempotency-Key header's value, or None when it was not sent."""
    if not values:
        return None
    # As with a repeated query parameter: taking either would be a guess.
    if len(values) > 1:
        raise InvalidInput("Idempotency-Key given more than once; send one")
    (value,) = values
    # The draft standard sends it as a quoted string; plain tokens are common too.
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not _IDEMPOTENCY_KEY.fullmatch(value):
        raise InvalidInput("Idempotency-Key must be 1 to 255 printable ASCII characters")
    return value


# If-Match (RFC 9110, 13.1.1): "*", or a list of entity tags, each W/ (weak)
# or not and quoted, of visible ASCII but the double quote; as a list, empty
# elements and spaces or tabs around commas are allowed. Only ASCII: obs-text
# (bytes 0x80-0xFF) is refused too, as the OpenAPI document's pattern (this
# one, word for word) says. Several If-Match lines count as one list.
IF_MATCH_PATTERN = (
    r'^(?:[ \t]*\*[ \t]*|[ \t,]*(?:W/)?"[!#-~]*"(?:[ \t]*,[ \t,]*(?:W/)?"[!#-~]*")*[ \t,]*)$'
)
_IF_MATCH = re.compile(IF_MATCH_PATTERN)
_ENTITY_TAG = re.compile(r'(W/)?"([!#-~]*)"')
# The versions an ETag of ours names: "1", "2", ... with no leading zero.
_VERSION_TAG = re.compile(r"[1-9][0-9]{0,18}")


def if_match_versions(values: Sequence[str]) -> frozenset[int] | None:
    """The product versions the If-Match header lines ``values`` accept; None for ``*``.

    Strong comparison (RFC 9110, 13.1.1): a weak tag matches nothing, and a
    tag of another form (``"v3"``, ``"03"``) names no version of ours, so it
    matches nothing either: such a header is well-formed, and a write with it
    fails its precondition (412), not the request's syntax (400). Raises
    InvalidInput for a header that is not If-Match syntax. ``values`` must
    not be empty: a request without If-Match is the caller's to answer (428).
    """
    value = ", ".join(values)
    if not _IF_MATCH.fullmatch(value):  # not match(): $ would let a final newline in
        raise InvalidInput(
            'If-Match must be the ETag of the product as you read it, quoted (If-Match: "3"),'
            " or a comma-separated list of them"
        )
    if value.strip(" \t") == "*":
        return None
    versions = set()
    for weak, tag in _ENTITY_TAG.findall(value):
        if not weak and _VERSION_TAG.fullmatch(tag) and int(tag) <= ID_MAX:
            versions.add(int(tag))
    return frozenset(versions)


def page_params(query: MultiMapping[str]) -> tuple[int, int]:
    """(after_id, limit) from ``?after=&limit=``."""
    unknown = sorted(set(query) - {"after", "limit"})
    if unknown:
        raise InvalidInput(
            f"unknown query parameter(s): {', '.join(unknown)}; allowed: after, limit"
        )
    # ?limit=1&limit=200 has no one meaning; taking either would be a guess.
    repeated = sorted({name for name in query if len(query.getall(name)) > 1})
    if repeated:
        raise InvalidInput(f"query parameter(s) given more than once: {', '.join(repeated)}")
    limit = _int_param(query, "limit", PAGE_DEFAULT, 1, PAGE_MAX)
    after = _int_param(query, "after", 0, 0, ID_MAX)
    return after, limit


def ascii_int(text: str, low: int, high: int) -> int | None:
    """``text`` as an integer from ``low`` to ``high``, or None.

    ASCII digits only: no sign, no spaces, and not the digits of other scripts,
    which int() would take.
    """
    if not (text.isascii() and text.isdigit()):
        return None
    # int() raises ValueError past 4300 digits (sys.get_int_max_str_digits),
    # leading zeros included; more digits than ``high`` has are out of range anyway.
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(high)):
        return None
    value = int(digits)
    return value if low <= value <= high else None


def _int_param(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    value = ascii_int(raw, low, high)
    if value is None:
        raise InvalidInput(f"query parameter '{name}' must be an integer from {low} to {high}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
