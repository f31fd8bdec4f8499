"""The rendezvous against hostile members and strangers: tokens that are not ASCII, strings
that would rewrite a terminal or split a JSON line, bodies nested past the limits. A real
server on loopback, raw HTTP."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from streamrl_cli.rendezvous.protocol import MAX_BODY_DEPTH, clean_text


def raw_request(base: httpx.URL, head: bytes) -> bytes:
    """Send raw request bytes (httpx refuses non-ASCII header values, a hostile client does not)."""
    with socket.create_connection((base.host, base.port), timeout=5) as s:
        s.sendall(head)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize(
    "token", ["Bearer \xe9t\xe9".encode("latin-1"), "Bearer jeton-é-ü".encode(), b"Bearer \xff\xfe\x80"]
)
def test_a_non_ascii_token_is_a_401_not_a_500(rendezvous_server, token):
    http, _ = rendezvous_server
    answer = raw_request(
        http.base_url,
        b"GET /v1/members HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + token + b"\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b'"unauthorized"' in answer
    assert http.get("/v1/members").status_code == 200  # and it keeps serving


def post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    """JSON with \\u escapes, as any client may send it (lone surrogates included)."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


HOSTILE = "\x1b[2J\x1b[31mpwned\x07\u2028next\u2029line\x00\x85\u202etxt.exe"


def test_member_strings_are_made_safe_before_metrics_jsonl_and_status(rendezvous_server):
    http, run_dir = rendezvous_server
    r = post(
        http, "/v1/register", {"role": "generator", "rank": 7, "host": HOSTILE, "info": {HOSTILE: HOSTILE}}
    )
    assert r.status_code == 200, r.text
    mid, cred = r.json()["member_id"], r.json()["credential"]
    r = post(http, "/v1/heartbeat", {"member_id": mid, "credential": cred, "state": "gen\x1b[0m\u2028"})
    assert r.status_code == 200
    record = {HOSTILE: HOSTILE, "ok": 1.5}
    r = post(http, "/v1/metrics", {"member_id": mid, "credential": cred, "record": record})
    assert r.status_code == 200, r.text
    text = (run_dir / "metrics.jsonl").read_bytes().decode()
    status = http.get("/v1/status").text
    for where in (text, status):
        for bad in ("\x1b", "\x07", "\u2028", "\u2029", "\x00", "\x85", "\u202e"):
            assert bad not in where
    # Visible, not lost: the terminal shows what was sent, escaped.
    line = json.loads(text.splitlines()[-1])
    assert line[clean_text(HOSTILE)] == clean_text(HOSTILE) and line["ok"] == 1.5
    assert "\\u001b[31mpwned" in clean_text(HOSTILE)
    # A lone surrogate is not text at all: refused, nothing written.
    r = post(http, "/v1/metrics", {"member_id": mid, "credential": cred, "record": {"x": "\ud800"}})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json"
    members = {m["member_id"]: m for m in http.get("/v1/status").json()["members"]}
    assert "\x1b" not in json.dumps(members[mid], ensure_ascii=False)


def test_a_body_nested_past_the_limit_is_a_400(rendezvous_server):
    http, _ = rendezvous_server
    deep = "[" * (MAX_BODY_DEPTH + 5) + "]" * (MAX_BODY_DEPTH + 5)
    body = '{"member_id": "generator-0", "record": {"x": ' + deep + "}}"
    r = http.post("/v1/metrics", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json"
    very = "[" * 100_000 + "]" * 100_000
    r = http.post("/v1/progress", content=very, headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 413, 422)
    assert http.get("/v1/members").status_code == 200
