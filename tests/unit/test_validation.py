from __future__ import annotations

from typing import Any

import pytest
from multidict import MultiDict

from service.validation import (
    ID_MAX,
    InvalidInput,
    ascii_int,
    idempotency_key,
    page_params,
    parse_json_object,
    validate_new_product,
)


def test_valid_product_is_trimmed() -> None:
    assert validate_new_product({"nama": "  Teh Hijau ", "harga": 45000}) == ("Teh Hijau", 45000)
    # U+FEFF is blank to JavaScript's \s, though not to str.strip().
    assert validate_new_product({"nama": " \ufeffX\ufeff ", "harga": 1}) == ("X", 1)
    assert validate_new_product({"nama": "\u3000Teh\xa0Hijau\t\n", "harga": 1})[0] == "Teh\xa0Hijau"
    assert validate_new_product({"nama": "x" * 200, "harga": 10**12})[1] == 10**12
    assert validate_new_product({"nama": "Gratis", "harga": 0})[1] == 0


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"harga": 1}, "'nama' is required"),
        ({"nama": "a"}, "'harga' is required"),
        ({"nama": "", "harga": 1}, "must not be empty"),
        ({"nama": "   ", "harga": 1}, "must not be empty"),
        ({"nama": "\ufeff", "harga": 1}, "must not be empty"),
        ({"nama": " \ufeff\u2003\ufeff ", "harga": 1}, "must not be empty"),
        # Whitespace to str.strip(), control characters to the OpenAPI document.
        ({"nama": "\x1cKopi", "harga": 1}, "control characters"),
        ({"nama": "Kopi\x85", "harga": 1}, "control characters"),
        ({"nama": "x" * 201, "harga": 1}, "at most 200"),
        ({"nama": 5, "harga": 1}, "must be a string"),
        ({"nama": "a\x00b", "harga": 1}, "control characters"),
        ({"nama": "a", "harga": True}, "not a boolean"),
        ({"nama": "a", "harga": 1.5}, "not a decimal number"),
        ({"nama": "a", "harga": 1.0}, "not a decimal number"),
        ({"nama": "a", "harga": "100"}, "not a string"),
        ({"nama": "a", "harga": -1}, "between 0 and"),
        ({"nama": "a", "harga": 10**12 + 1}, "between 0 and"),
        ({"nama": "a", "harga": 1, "stok": 3}, "unknown field(s): stok"),
    ],
)
def test_invalid_products_say_what_is_wrong(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_new_product(data)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", r"^body is not valid UTF-8 \(byte 0\); JSON is always UTF-8"),
        (b"[1, 2]", "not an array"),
        (b"null", "not null"),
        (b'"text"', "not a string"),
        (b'{"harga": NaN}', "^body is not valid JSON: NaN is not a JSON number$"),
        (b'\xef\xbb\xbf{"nama": "a", "harga": 1}', "byte order mark"),
        # json alone keeps the last: this would be stored as "b".
        (
            b'{"nama": "a", "harga": 1, "nama": "b"}',
            r"^field 'nama' is given twice; send each field once$",
        ),
        (b'{"harga": 1, "harga": 1}', r"^field 'harga' is given twice"),
        (
            b'{"x": {"' + b"k" * 200 + b'": 1, "' + b"k" * 200 + b'": 2}}',
            r"^field 'k{50}\.\.\. \(200 characters\)' is given twice",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        # int() refuses it with advice on sys.set_int_max_str_digits(): not ours to give.
        (
            b'{"harga": ' + b"9" * 5000 + b"}",
            r"^field 'harga' must be an integer from 0 to 1000000000000; "
            r"the body has one of 5000 digits$",
        ),
        (b'{"harga": -' + b"9" * 50 + b"}", "the body has one of 50 digits$"),
    ],
)
def test_bodies_that_are_not_json_objects(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        parse_json_object(body)


def test_page_params() -> None:
    assert page_params(MultiDict()) == (0, 50)
    assert page_params(MultiDict({"after": "10", "limit": "200"})) == (10, 200)
    for bad in ({"limit": "0"}, {"limit": "201"}, {"after": "-1"}, {"after": "x"}, {"page": "2"}):
        with pytest.raises(InvalidInput):
            page_params(MultiDict(bad))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("42", 42),
        ("0" * 5000 + "42", 42),
        (str(ID_MAX), ID_MAX),
        (str(ID_MAX + 1), None),
        ("1" * 5000, None),  # past int()'s 4300 digits: no ValueError, just None
        ("0" * 5000, 0),
        ("", None),
        ("-1", None),
        ("+1", None),
        (" 1", None),
        ("\u0661", None),  # ARABIC-INDIC DIGIT ONE: int() takes it
    ],
)
def test_ascii_int(text: str, value: int | None) -> None:
    assert ascii_int(text, 0, ID_MAX) == value


def test_page_params_with_5000_digits_say_what_is_wrong() -> None:
    with pytest.raises(InvalidInput, match=r"^query parameter 'limit' must be an integer from 1"):
        page_params(MultiDict({"limit": "9" * 5000}))
    with pytest.raises(InvalidInput, match=r"^query parameter 'after' must be an integer from 0"):
        page_params(MultiDict({"after": "9" * 5000}))
    assert page_params(MultiDict({"after": "0" * 5000 + "3", "limit": "0" * 5000 + "7"})) == (3, 7)


def test_idempotency_key() -> None:
    assert idempotency_key([]) is None
    assert idempotency_key(["order-1"]) == "order-1"
    assert idempotency_key(['"order-1"']) == "order-1"
    # Which one the client meant cannot be known, as with a repeated query parameter.
    with pytest.raises(InvalidInput, match=r"^Idempotency-Key given more than once"):
        idempotency_key(["a1", "b2"])


def test_a_repeated_page_param_is_refused_not_guessed() -> None:
    with pytest.raises(InvalidInput, match="more than once: limit"):
        page_params(MultiDict([("limit", "1"), ("limit", "200")]))
