"""The HTTP request reader and the JSON body rules, driven with plain bytes (no sockets)."""

from __future__ import annotations

import json
import random

import pytest

from ascendbind.daemon.api.requests import (MAX_JSON_DEPTH, NPU_MAX, PID_MAX, PlanAsk, decode_json_body,
                                            json_depth, parse_bind_request)
from ascendbind.values.targeting import TargetRequest
from ascendbind.daemon.api.wire import (MAX_HEAD, MAX_HEADERS, MAX_LINE, Request, RequestReader, Response, WireError,
                                        json_response, render_response)
from ascendbind.errors import UsageError

GOOD = b'POST /v1/bind?x=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: 12\r\nX-Request-Id: a\r\n\r\n{"npu": [0]}'


def read(data: bytes, max_body: int = 1024) -> Request | None:
    return RequestReader(max_body).feed(data)


def refused(data: bytes, max_body: int = 1024) -> WireError:
    with pytest.raises(WireError) as e:
        read(data, max_body)
    return e.value


def test_a_whole_request_in_one_piece_or_byte_by_byte_is_the_same():
    whole = read(GOOD)
    assert whole == Request("POST", "/v1/bind?x=1", "/v1/bind", "x=1", "HTTP/1.1",
                            (("host", "localhost"), ("content-length", "12"), ("x-request-id", "a")), b'{"npu": [0]}')
    r = RequestReader(1024)
    got = [r.feed(GOOD[i:i + 1]) for i in range(len(GOOD))]
    assert got[:-1] == [None] * (len(GOOD) - 1) and got[-1] == whole
    assert whole.header("X-REQUEST-ID") == "a" and whole.header("absent") is None


def test_line_done_turns_true_with_the_request_line_only():
    r = RequestReader(1024)
    assert r.feed(b"GET /healthz HTT") is None and not r.line_done
    assert r.feed(b"P/1.0\r\nHost") is None and r.line_done


@pytest.mark.parametrize("data", [
    b"GET /healthz HTTP/1.0\r\n\r\n",
    b"GET /healthz HTTP/1.1\n\n",                      # bare LF line ends
    b"\r\nGET /healthz HTTP/1.1\r\n\r\n",              # a stray CRLF before the request line
    b"GET http://localhost/healthz HTTP/1.1\r\n\r\n",  # absolute-form
    b"GET /healthz HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nX-Latin: caf\xe9\r\n\r\n",
])
def test_tolerated_forms(data):
    req = read(data)
    assert req is not None and req.path == "/healthz" and req.body == b""


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"GET /healthz HTTP/2.0\r\n\r\n", 505, "http_version_not_supported"),
    (b"GET /healthz HTTP/0.9\r\n\r\n", 505, "http_version_not_supported"),
    (b"GET /healthz\r\n\r\n", 400, "bad_http"),                    # HTTP/0.9 simple request
    (b"GET /healthz HTTP/1\r\n\r\n", 400, "bad_http"),
    (b"GET  /healthz HTTP/1.1\r\n\r\n", 400, "bad_http"),
    (b"G(T /healthz HTTP/1.1\r\n\r\n", 400, "bad_http"),
    (b"GET healthz HTTP/1.1\r\n\r\n", 400, "bad_http"),
    (b"GET /h\xc3\xa9 HTTP/1.1\r\n\r\n", 400, "bad_http"),
    (b"GET /healthz HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 400, "bad_http"),
    (b"GET /healthz HTTP/1.1\r\nX : a\r\n\r\n", 400, "bad_http"),
    (b"GET /healthz HTTP/1.1\r\nno colon\r\n\r\n", 400, "bad_http"),
    (b"GET /healthz HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400, "bad_http"),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "bad_http"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "bad_http"),
    (b"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", 400, "bad_http"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411, "length_required"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400, "bad_http"),
    (b"POST / HTTP/1.1\r\nContent-Length: 1025\r\n\r\n", 413, "body_too_large"),
    (b"POST / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 400, "bad_http"),
])
def test_refused_heads(data, status, code):
    err = refused(data)
    assert (err.status, err.code) == (status, code) and err.detail


def test_caps_on_line_head_and_header_count():
    assert refused(b"GET /" + b"a" * MAX_LINE).status == 400  # no line end yet, already too long
    assert refused(b"GET /healthz HTTP/1.1\r\nX: " + b"y" * MAX_HEAD).status == 400
    many = b"".join(b"X%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    assert "header fields" in refused(b"GET / HTTP/1.1\r\n" + many + b"\r\n").detail
    assert read(b"GET / HTTP/1.1\r\n" + many[: many.rindex(b"X")] + b"\r\n") is not None


def test_a_bad_request_line_is_refused_before_the_head_is_complete():
    r = RequestReader(1024)
    with pytest.raises(WireError):
        r.feed(b"GET /healthz HTTP/2.0\r\nHost: x\r\n")


def test_eof_before_the_end_is_an_error_never_a_request():
    for cut in range(len(GOOD)):
        r = RequestReader(1024)
        assert r.feed(GOOD[:cut]) is None
        err = r.feed_eof()
        assert (err.status, err.code) == (400, "incomplete_request")


def test_expect_continue_is_wanted_only_while_the_body_is_missing():
    head = b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    r = RequestReader(1024)
    assert r.feed(head) is None and r.wants_continue
    assert r.feed(b"{}").body == b"{}" and not r.wants_continue
    r = RequestReader(1024)
    assert r.feed(head + b"{}") is not None and not r.wants_continue


def test_random_bytes_never_escape_as_anything_but_wire_errors():
    rng = random.Random(5)
    alphabet = b"GETPOST /HTP1.0\r\n:;-\x00\xff0123456789"
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(80)))
        r = RequestReader(16)
        try:
            r.feed(data)
            r.feed_eof()
        except WireError:
            pass


def test_rendered_answers_carry_a_status_line_length_and_close():
    wire = render_response(json_response(405, {"error": "method_not_allowed", "detail": "x"}, {"Allow": "POST"}),
                           request_id="r1")
    head, _, body = wire.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 405 Method Not Allowed"
    assert {b"Connection: close", b"Allow: POST", b"X-Request-Id: r1", b"Content-Length: %d" % len(body)} <= set(lines)
    assert json.loads(body)["error"] == "method_not_allowed"
    assert render_response(Response(200, b"abc", "text/plain"), head_only=True).endswith(b"Content-Length: 3\r\nConnection: close\r\n\r\n")


# ---------------------------------------------------------------- JSON bodies


@pytest.mark.parametrize(("text", "depth"), [
    ("{}", 1), ('{"a": [1, {"b": []}]}', 4), ('"[[[[{{{{"', 0), ('{"a": "\\"[[["}', 1), ("", 0), ("[1, 2", 1),
])
def test_json_depth_ignores_brackets_inside_strings_and_bounds_unbalanced_text(text, depth):
    assert json_depth(text) == depth


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


def test_json_depth_is_exact_on_random_json_with_brackets_quotes_and_escapes_in_strings():
    rng = random.Random(11)

    def value(level: int = 0):
        kind = rng.randrange(6 if level < 10 else 3)
        if kind == 0:
            return rng.choice(['[{"', '\\"]', "x", "", '""', "}]", "\\", "\u005b"])
        if kind in (1, 2):
            return rng.choice([0, None, True, 1.5])
        if kind == 3:
            return [value(level + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(["a", "[", '"{', "\\"]): value(level + 1) for _ in range(rng.randrange(3))}

    for _ in range(3000):
        doc = value()
        assert json_depth(json.dumps(doc)) == _nesting(doc), json.dumps(doc)


@pytest.mark.parametrize("raw", [
    b"[" * 5000 + b"]" * 5000, b"[" * 100000, b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
    b"\xff", b"{", b'{"pid": ' + b"9" * 5000 + b"}", b"\xed\xa0\x80",
])
def test_hostile_bodies_are_usage_errors(raw):
    with pytest.raises(UsageError) as e:
        decode_json_body(raw)
    assert e.value.code == "bad_json"


def test_empty_body_is_an_empty_object_and_depth_at_the_limit_is_fine():
    assert decode_json_body(b"  ") == {}
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert decode_json_body(nested.encode()) == json.loads(nested)


@pytest.mark.parametrize("body", [
    {"npu": [0, 1, None]}, {"npu": [None]}, {"npu": []}, {"npu": [0] * 65}, {"npu": [True]},
    {"pid": PID_MAX + 1}, {"pid": 10**40}, {"npu": NPU_MAX + 1}, {"pid": 1.0}, {"pid": float("nan")},
    {"topology_policy": ["none"]}, {"topology_policy": {"a": 1}}, {"topology_policy": 3},
    {"pool_source": "own"}, {"pool_source": ["cpuset"]}, {"pool_source": 1}, {"pool_source": "CPUSET"},
    {"x" * 1000: 1}, [], None, "pid",
])
def test_bind_bodies_that_are_400(body):
    with pytest.raises(UsageError) as e:
        parse_bind_request(body)
    assert e.value.code == "bad_request" and len(str(e.value)) < 400


def test_bind_bodies_that_are_fine():
    assert parse_bind_request({"pid": PID_MAX, "npu": [3, 1, 3]}) == (PID_MAX, TargetRequest(npus=(1, 3)), PlanAsk())
    assert parse_bind_request({"npu": 0, "topology_policy": "restricted"}) == \
        (None, TargetRequest(npus=(0,)), PlanAsk("restricted"))
    assert parse_bind_request({"npu": 0, "pool_source": "cpuset"}) == \
        (None, TargetRequest(npus=(0,)), PlanAsk(pool_source="cpuset"))
    assert parse_bind_request({}) == (None, TargetRequest(), PlanAsk())
