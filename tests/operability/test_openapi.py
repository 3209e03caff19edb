"""The OpenAPI document against the live service: schemathesis, and coverage of the routes.

schemathesis generates requests from service/openapi.json (valid and invalid
ones) and checks every answer of a real toko-api: no 5xx, a documented
status, the documented content type, body and headers, and writes refused
without the token.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import secrets
import sys
import unicodedata
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.checks import ensure_resource_availability, use_after_free

import service
from service.app import create_app
from service.openapi import openapi_document
from service.settings import Settings
from service.validation import (
    IF_MATCH_PATTERN,
    NAMA_BLANKS,
    InvalidInput,
    idempotency_key,
    if_match_versions,
    validate_new_product,
)
from tests.support.service import ServiceProcess

TOKEN = "oas-" + secrets.token_hex(16)
# Bounded so the whole module stays well under a minute.
MAX_EXAMPLES = 50
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    # Writes without the token must be refused (the document says POST needs it).
    ignored_auth,
    # Requests the document calls invalid must get a 4xx, not be stored.
    negative_data_rejection,
    # Not positive_data_acceptance: schemathesis' generator treats the nama
    # pattern loosely and sends control characters the pattern excludes.
]


@pytest.fixture(scope="module")
def live_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("openapi")
    token_file = workdir / "api-token"
    token_file.write_text(TOKEN + "\n")
    svc = ServiceProcess(workdir / "svc", {"TOKO_API_TOKEN_FILE": str(token_file)}).start()
    try:
        svc.wait_ready(timeout=20)
        yield svc
    finally:
        svc.terminate()
        code = svc.wait_exit(15)
        svc.close()
        assert code == 0, svc.output_tail()


# The repository's document; test_service_serves_the_repository_document
# shows the live service serves exactly this. (Loading it from the live service through
# schemathesis.pytest.from_fixture fails on pytest 9: it reads a removed
# private attribute, Node._nodeid.)
schema = schemathesis.openapi.from_path(Path(service.__file__).parent / "openapi.json")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout
    # The same examples every run: a shared main must not turn red by chance.
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_live_api_conforms_to_openapi(case: Any, live_service: ServiceProcess) -> None:
    case.call_and_validate(
        base_url=live_service.base_url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        checks=CHECKS,
    )


def test_service_serves_the_repository_document(live_service: ServiceProcess) -> None:
    with urllib.request.urlopen(live_service.url("/openapi.json"), timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers.get_content_type() == "application/json"
        served = resp.read()
    assert served == (Path(service.__file__).parent / "openapi.json").read_bytes()


def test_the_document_allows_a_nama_the_service_takes(live_service: ServiceProcess) -> None:
    # The service trims first: 203 characters that trim to 200 are a good nama,
    # so a client validating against the document must not refuse them.
    nama = "   " + "a" * 200
    assert _stored_nama(live_service, nama) == "a" * 200
    doc = json.loads(openapi_document())
    rules = doc["components"]["schemas"]["NewProduct"]["properties"]["nama"]
    assert rules.get("minLength", 0) <= len(nama) <= rules.get("maxLength", len(nama)), rules
    assert re.search(rules["pattern"], nama), rules
    assert "then 1-200 characters" in rules["description"]


@pytest.mark.parametrize(
    "sent",
    [
        "k",
        "order-42",
        "a b",
        "x" * 255,
        '"quoted key"',
        '" spaced inside quotes "',
        '"' + "x" * 255 + '"',
        '"',
        " ",
        "",
        '""',
        '"   "',
        "x" * 256,
        '"' + "x" * 256 + '"',
        "caf\u00e9",
        "tab\there",
    ],
)
def test_the_idempotency_key_rules_are_the_services(sent: str) -> None:
    # The header value as the handler gets it: HTTP drops the spaces around a
    # field value, so a plain key that starts or ends with one never arrives
    # as sent, and the document must not call it valid either.
    doc = json.loads(openapi_document())
    (param,) = doc["paths"]["/produk"]["post"]["parameters"]
    schema = param["schema"]
    documented = (
        re.search(schema["pattern"], sent) is not None
        and schema["minLength"] <= len(sent) <= schema["maxLength"]
    )
    arrives = sent.strip(" \t")
    try:
        taken = arrives == sent and idempotency_key([arrives]) is not None
    except InvalidInput:
        taken = False
    assert documented == taken, (sent, schema)


# What \s matches in JavaScript (ECMA-262 WhiteSpace and LineTerminator), which
# is how a client reads the document's patterns; Python's \s differs (it has
# no U+FEFF, but U+001C-U+001F and U+0085).
ECMASCRIPT_BLANKS = {
    chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Zs"
} | set("\t\v\f\ufeff\n\r\u2028\u2029")


def _nama_pattern_as_javascript_reads_it() -> re.Pattern[str]:
    doc = json.loads(openapi_document())
    pattern = doc["components"]["schemas"]["NewProduct"]["properties"]["nama"]["pattern"]
    blanks = "".join(f"\\u{ord(c):04x}" for c in sorted(ECMASCRIPT_BLANKS))
    # Inside a character class \s stands for its members; outside, for a class of them.
    pattern = pattern.replace("[^\\s", "[^" + blanks)
    return re.compile(pattern.replace("\\s", f"[{blanks}]"))


def _service_takes(nama: str) -> bool:
    try:
        validate_new_product({"nama": nama, "harga": 1})
    except InvalidInput:
        return False
    return True


def test_the_service_trims_what_the_document_calls_blank() -> None:
    assert set(NAMA_BLANKS) == ECMASCRIPT_BLANKS


def test_the_document_and_the_service_agree_on_every_one_character_nama() -> None:
    pattern = _nama_pattern_as_javascript_reads_it()
    disagree = [
        f"U+{c:04X}"
        for c in range(sys.maxunicode + 1)
        if _service_takes(chr(c)) != bool(pattern.search(chr(c)))
    ]
    assert not disagree


# One of each kind of character the rules tell apart: a letter, blanks (some
# of them control characters too), control characters that are no blank, a
# line separator.
NAMA_ALPHABET = ["a", " ", "\xa0", "\ufeff", "\t", "\n", "\r", "\u2028", "\x00", "\x1c", "\x85"]


def test_the_document_and_the_service_agree_on_every_short_nama() -> None:
    # The ends matter: the service trims blanks that are control characters
    # (a trailing line break, say) before it looks for control characters.
    pattern = _nama_pattern_as_javascript_reads_it()
    names = [
        "".join(chars)
        for length in (1, 2, 3, 4)
        for chars in itertools.product(NAMA_ALPHABET, repeat=length)
    ]
    disagree = [name for name in names if _service_takes(name) != bool(pattern.search(name))]
    assert not disagree, disagree[:10]


def test_a_nama_blank_only_to_javascript_is_trimmed(live_service: ServiceProcess) -> None:
    nama = " \ufeffX\ufeff "
    assert _nama_pattern_as_javascript_reads_it().search(nama)
    assert _stored_nama(live_service, nama) == "X"


def _stored_nama(live_service: ServiceProcess, nama: str) -> str:
    """POST a product named ``nama``; the name the service stored (after a 201)."""
    request = urllib.request.Request(
        live_service.url("/produk"),
        data=json.dumps({"nama": nama, "harga": 1}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 201
        stored: str = json.loads(resp.read())["nama"]
    return stored


def test_document_is_the_one_in_the_repository() -> None:
    shipped = Path(service.__file__).parent / "openapi.json"
    assert openapi_document() == shipped.read_bytes()
    doc = json.loads(shipped.read_text())
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["version"] == service.__version__


def test_every_route_is_documented_with_json_errors() -> None:
    app = create_app(Settings())
    doc = json.loads(openapi_document())
    served = {
        (re.sub(r"\{(\w+):[^}]+\}", r"{\1}", resource.canonical), route.method.lower())
        for resource in app.router.resources()
        for route in resource
        if route.method != "HEAD"  # aiohttp adds HEAD beside every GET
    }
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400 and path != "/healthz":
                    content = answer["content"]["application/json"]["schema"]
                    assert content == {"$ref": "#/components/schemas/Error"}, (path, method, status)
    post = doc["paths"]["/produk"]["post"]
    assert post["security"] == [{"bearerAuth": []}]
    assert "401" in post["responses"]
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


# Changes and deletes ------------------------------------------------------------------

STATEFUL_CHECKS = [*CHECKS, use_after_free, ensure_resource_availability]
# The steps the links must lead to: create, read, change, delete, read again.
WORKFLOW = {("POST", 201), ("GET", 200), ("PATCH", 200), ("DELETE", 204), ("GET", 404)}


def test_stateful_create_read_patch_delete_through_the_links(
    live_service: ServiceProcess,
) -> None:
    # The links hand each step the id and the ETag the step before answered
    # with: a PATCH or DELETE made from them gets a 2xx, and once a DELETE
    # went through, reads of the product are 404 (use_after_free).
    seen: set[tuple[str, int]] = set()
    failures: list[Exception] = []
    auth = {"Authorization": f"Bearer {TOKEN}"}

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case: Any) -> None:
            # A key used again is answered from the live service's past (a
            # product changed since): every POST here makes a product.
            if case.headers:
                case.headers.pop("Idempotency-Key", None)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": live_service.base_url, "headers": auth}

        def after_call(self, response: Any, case: Any) -> None:
            super().after_call(response, case)
            seen.add((case.method.upper(), response.status_code))

        def validate_response(
            self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any
        ) -> None:
            try:
                case.validate_response(
                    response,
                    checks=STATEFUL_CHECKS,
                    headers=auth,
                    transport_kwargs=kwargs,
                    recorder=getattr(self, "recorder", None),
                )
            except Exception as exc:
                failures.append(exc)
                raise

    # The live service's state moves on (products made, changed, deleted), so
    # a scenario Hypothesis replays may draw differently: Flaky ends the run
    # then, as it does schemathesis' own. A failed check fails the test all
    # the same: it was recorded as it happened.
    with contextlib.suppress(Flaky):
        Workflow.run(
            settings=settings(
                max_examples=MAX_EXAMPLES,
                stateful_step_count=6,
                phases=[Phase.generate],
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
        )
    assert failures == []
    assert seen >= WORKFLOW, sorted(seen)


def test_the_change_and_delete_routes_are_documented_with_their_headers() -> None:
    doc = json.loads(openapi_document())
    item = doc["paths"]["/produk/{id}"]
    etag = {"ETag"}
    assert set(item["get"]["responses"]["200"]["headers"]) == etag
    assert etag <= set(doc["paths"]["/produk"]["post"]["responses"]["201"]["headers"])
    for method, written in (("patch", "200"), ("delete", "204")):
        op = item[method]
        assert op["security"] == [{"bearerAuth": []}], method
        (if_match,) = [p for p in op["parameters"] if p["in"] == "header"]
        assert (if_match["name"], if_match["required"]) == ("If-Match", True)
        # The document's pattern is the service's, word for word.
        assert if_match["schema"]["pattern"] == IF_MATCH_PATTERN
        assert {"400", "401", "404", "412", "428", "503"} <= set(op["responses"]), method
        assert set(op["responses"][written]["headers"]) == etag, method
        assert op["responses"][written]["headers"]["ETag"]["required"] is True
    # What a PATCH may set follows the rules of a new product, field by field.
    schemas = doc["components"]["schemas"]
    change = schemas["ProductChange"]
    assert change["properties"] == schemas["NewProduct"]["properties"]
    assert (change["additionalProperties"], change["minProperties"]) == (False, 1)
    assert "required" not in change
    # Every link names an operation that exists, with its parameters.
    operations = {op["operationId"]: op for ops in doc["paths"].values() for op in ops.values()}
    links = [
        link
        for ops in doc["paths"].values()
        for op in ops.values()
        for answer in op["responses"].values()
        for link in answer.get("links", {}).values()
    ]
    assert {link["operationId"] for link in links} == {
        "getProduct",
        "updateProduct",
        "deleteProduct",
    }
    for link in links:
        names = {p["name"] for p in operations[link["operationId"]]["parameters"]}
        assert {name.rpartition(".")[2] for name in link["parameters"]} == names, link


@pytest.mark.parametrize(
    "sent",
    [
        '"1"',
        '"12", "3"',
        ' "1" ',
        '"1",,"2",',
        ', "1"',
        'W/"1"',
        '"v1"',
        '"a,b"',
        '""',
        "*",
        " * ",
        "",
        " ",
        ",",
        "1",
        '"1',
        '1"',
        '"1" "2"',
        '*, "1"',
        "**",
        'w/"1"',
        'W/ "1"',
        '"caf\u00e9"',
        '"a"b"',
        '"\t"',
        '"1"\n',
    ],
)
def test_the_if_match_rules_are_the_services(sent: str) -> None:
    doc = json.loads(openapi_document())
    (if_match,) = [
        p for p in doc["paths"]["/produk/{id}"]["patch"]["parameters"] if p["in"] == "header"
    ]
    # $ in a JavaScript pattern matches only at the very end: fullmatch, as there.
    documented = re.fullmatch(if_match["schema"]["pattern"].strip("^$"), sent) is not None
    try:
        if_match_versions([sent])
    except InvalidInput:
        taken = False
    else:
        taken = True
    assert documented == taken, sent
