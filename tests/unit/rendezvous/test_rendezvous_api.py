"""The rendezvous HTTP API at its edges: authentication and malformed requests.

The server runs in a thread of the test process (``server.run`` with a stop event), on a
real loopback socket, so that its log lines can be checked with caplog. Every request
here is raw httpx, the way curl or a buggy member would send it, not through the client.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from support.helpers import rendezvous_in_thread

ENDPOINTS = [
    ("POST", "/v1/register"),
    ("POST", "/v1/heartbeat"),
    ("POST", "/v1/leave"),
    ("GET", "/v1/members"),
    ("GET", "/v1/events"),
    ("GET", "/v1/versions"),
    ("POST", "/v1/versions/propose"),
    ("POST", "/v1/versions/confirm"),
    ("POST", "/v1/metrics"),
    ("POST", "/v1/progress"),
    ("POST", "/v1/scale"),
    ("GET", "/v1/status"),
]

CREDENTIALS: dict[str, str] = {}  # member_id -> what /v1/register returned (the `api` fixture's members)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(http client with the token, run dir): a server in a thread, shared by this module."""
    run_dir = tmp_path_factory.mktemp("rendezvous-api")
    with rendezvous_in_thread(run_dir) as http:
        r = http.post("/v1/register", json={"role": "generator", "rank": 0})
        assert r.status_code == 200, r.text
        CREDENTIALS[r.json()["member_id"]] = r.json()["credential"]
        yield http


def test_healthz_needs_no_token(api):
    r = httpx.get(api.base_url.join("/healthz"))
    assert r.status_code == 200 and r.json() == {"ok": True}


@pytest.mark.parametrize("method,path", ENDPOINTS, ids=[p for _, p in ENDPOINTS])
@pytest.mark.parametrize(
    "auth", [None, "Bearer not-the-token", "Basic dXNlcjpwdw=="], ids=["missing", "wrong", "basic"]
)
def test_every_endpoint_rejects_a_missing_or_wrong_token(api, caplog, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    caplog.set_level(logging.WARNING, logger="streamrl.rendezvous")
    with httpx.Client(base_url=api.base_url, timeout=5) as anonymous:
        r = anonymous.request(method, path, headers=headers, json={"role": "trainer", "rank": 0})
    assert r.status_code == 401
    assert r.json()["error"] == "unauthorized" and "Authorization: Bearer" in r.json()["message"]
    lines = [rec.getMessage() for rec in caplog.records if "unauthorized" in rec.getMessage()]
    assert len(lines) == 1 and path in lines[0] and "127.0.0.1" in lines[0]
    assert "trainer-0" not in {m["member_id"] for m in api.get("/v1/members").json()["members"]}


BIG = {"role": "generator", "rank": 1, "info": {"blob": "x" * (300 * 1024)}}
JSON = {"Content-Type": "application/json"}
# id: (method, path, body: dict (sent as JSON) | bytes (sent as-is), headers, status, error code, in message)
MALFORMED = {
    "not-json": ("POST", "/v1/register", b"{role: generator", JSON, 400, "invalid_json", "not a JSON"),
    "empty-body": ("POST", "/v1/heartbeat", b"", JSON, 400, "invalid_json", "not a JSON"),
    "not-utf8": ("POST", "/v1/heartbeat", b'{"member_id": "\xff"}', JSON, 400, "invalid_json", ""),
    "array-body": ("POST", "/v1/register", b"[1, 2]", JSON, 422, "invalid_body", "Expected `object`"),
    "wrong-type": ("POST", "/v1/register", {"role": "generator", "rank": "0"}, {}, 422, "", "$.rank"),
    "missing-field": ("POST", "/v1/register", {"role": "generator"}, {}, 422, "", "`rank`"),
    "unknown-field": (
        "POST",
        "/v1/heartbeat",
        {"member_id": "generator-0", "weight_verison": 1},
        {},
        422,
        "",
        "weight_verison",
    ),
    "negative-rank": ("POST", "/v1/register", {"role": "generator", "rank": -1}, {}, 422, "", ">= 0"),
    "negative-version": (
        "POST",
        "/v1/versions/propose",
        {"version": -3, "required_roles": ["generator"]},
        {},
        422,
        "",
        ">= 0 - at `$.version`",
    ),
    "no-required-roles": (
        "POST",
        "/v1/versions/propose",
        {"version": 3, "required_roles": []},
        {},
        422,
        "",
        "length >= 1",
    ),
    "zero-incarnation": (
        "POST",
        "/v1/versions/propose",
        {"version": 3, "required_roles": ["generator"], "members": {"generator-0": 0}},
        {},
        422,
        "invalid_body",
        ">= 1",
    ),
    "huge-transfer": (
        "POST",
        "/v1/versions/propose",
        {"version": 3, "required_roles": ["generator"], "transfer": {"ranks": "x" * 140_000}},
        {},
        422,
        "invalid_body",
        "transfer is too large",
    ),
    "bad-role-name": ("POST", "/v1/register", {"role": "gen erator!", "rank": 0}, {}, 422, "", "$.role"),
    "bad-address": (
        "POST",
        "/v1/register",
        {"role": "generator", "rank": 2, "addresses": {"s": "node:99999"}},
        {},
        422,
        "invalid_body",
        "'host:port'",
    ),
    "unknown-member": (
        "POST",
        "/v1/heartbeat",
        {"member_id": "generator-99"},
        {},
        404,
        "unknown_member",
        "register first",
    ),
    "unknown-version": (
        "POST",
        "/v1/versions/confirm",
        {"member_id": "generator-0", "version": 77},
        {},
        404,
        "unknown_version",
        "never proposed",
    ),
    "reserved-metric": (
        "POST",
        "/v1/metrics",
        {"member_id": "generator-0", "record": {"rank": 5}},
        {},
        422,
        "",
        "reserved",
    ),
    "metrics-too-big": (
        "POST",
        "/v1/metrics",
        {"member_id": "generator-0", "record": {"x": "y" * 20000}},
        {},
        422,
        "",
        "too large",
    ),
    "step-is-bool": (
        "POST",
        "/v1/progress",
        {"step": True},
        {},
        422,
        "",
        "'step' must be an integer in 0..2**63-1",
    ),
    "negative-step": ("POST", "/v1/progress", {"step": -1}, {}, 422, "", "'step'"),
    "nested-too-deep": (
        "POST",
        "/v1/metrics",
        {"member_id": "generator-0", "record": {"a": [[[[[[[[[1]]]]]]]]]}},
        {},
        422,
        "",
        "nests deeper than 8",
    ),
    "recursion-bomb": (
        "POST",
        "/v1/progress",
        b'{"step": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        JSON,
        400,
        "invalid_json",
        "nested too deeply",
    ),
    "huge-body": ("POST", "/v1/register", BIG, {}, 413, "body_too_large", "larger than"),
    "wrong-content-type": (
        "POST",
        "/v1/register",
        b"role=generator&rank=0",
        {"Content-Type": "application/x-www-form-urlencoded"},
        415,
        "",
        "application/json",
    ),
    "unknown-path": ("GET", "/v1/nothing-here", None, {}, 404, "not_found", "no endpoint"),
    "wrong-method": ("GET", "/v1/register", None, {}, 405, "method_not_allowed", "allowed: ['POST']"),
    "negative-since": ("GET", "/v1/events?since=-1", None, {}, 400, "invalid_query", "since"),
    "nan-timeout": ("GET", "/v1/events?timeout=nan", None, {}, 400, "invalid_query", "timeout"),
    "unknown-query": ("GET", "/v1/members?rol=generator", None, {}, 400, "invalid_query", "['role']"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_request_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(api, case):
    method, path, body, headers, status, code, needle = MALFORMED[case]
    if isinstance(body, dict) and body.get("member_id") in CREDENTIALS:  # in its own name
        body = {**body, "credential": CREDENTIALS[body["member_id"]]}
    if isinstance(body, dict):
        r = api.request(method, path, json=body, headers=headers)
    else:
        r = api.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["error"] == (code or doc["error"]) and needle in doc["message"], doc
    if method == "POST" and path != "/v1/nothing-here" and status in (400, 415, 422):
        assert "expected" in doc  # the answer shows a valid body
    assert api.get("/healthz").json() == {"ok": True}
    assert api.get("/v1/status").status_code == 200


def test_rejected_requests_leave_no_trace(api, tmp_path):
    status = api.get("/v1/status").json()
    assert sorted(m["member_id"] for m in status["members"]) == ["generator-0"]
    assert status["versions"]["pending"] == [] and status["progress"] == {}


def test_scale_request_is_an_event_and_in_status(api):
    since = api.get("/v1/versions").json()["event_seq"]
    r = api.post(
        "/v1/scale", json={"role": "generator", "instances": 2, "source": "user", "reason": "by hand"}
    )
    assert r.status_code == 200, r.text
    seq = r.json()["seq"]
    events = api.get("/v1/events", params={"since": since}).json()["events"]
    ev = next(e for e in events if e["seq"] == seq)
    assert ev["type"] == "scale_requested"
    assert ev["data"] == {"role": "generator", "instances": 2, "source": "user", "reason": "by hand"}
    assert api.get("/v1/status").json()["scale"]["generator"]["instances"] == 2


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"role": "trainer", "instances": 2}, 409, "only the generator role"),
        ({"role": "generator", "instances": -1}, 422, "$.instances"),
        ({"role": "generator", "instances": 1, "source": "someone"}, 422, "$.source"),
        ({"role": "generator"}, 422, "`instances`"),
    ],
)
def test_bad_scale_request_names_the_problem(api, body, status, needle):
    r = api.post("/v1/scale", json=body)
    assert r.status_code == status and needle in r.json()["message"], r.text


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/heartbeat", {"state": "hijacked"}),
        ("/v1/leave", {"reason": "hijacked"}),
        ("/v1/metrics", {"record": {"hijacked": 1}}),
    ],
    ids=["heartbeat", "leave", "metrics"],
)
@pytest.mark.parametrize(
    "credential", [None, "", "0" * 64, "é"], ids=["missing", "empty", "wrong", "non-ascii"]
)
def test_a_holder_of_the_token_cannot_speak_in_another_members_name(api, path, body, credential):
    # Only the process that registered generator-0 got its credential; the run's token is not enough.
    extra = {} if credential is None else {"credential": credential}
    r = api.post(path, json={"member_id": "generator-0", **body, **extra})
    assert r.status_code == 403, r.text
    doc = r.json()
    assert doc["error"] == "bad_credential" and "generator-0" in doc["message"], doc
    assert "POST /v1/register" in doc["message"]
    (g,) = [m for m in api.get("/v1/status").json()["members"] if m["member_id"] == "generator-0"]
    assert g["state"] == "alive" and g.get("reported_state") != "hijacked", g
    # ... while the member itself, with its credential, is heard
    own = {"member_id": "generator-0", "credential": CREDENTIALS["generator-0"]}
    assert api.post("/v1/heartbeat", json=own).status_code == 200


def test_credentials_outlive_a_server_restart_and_a_superseded_process_cannot_end_its_successor(tmp_path):
    with rendezvous_in_thread(tmp_path) as http:
        first = http.post("/v1/register", json={"role": "trainer", "rank": 0}).json()
    with rendezvous_in_thread(tmp_path) as http:  # the same run directory: restarted from its journal
        body = {"member_id": first["member_id"], "credential": first["credential"]}
        assert http.post("/v1/heartbeat", json=body).status_code == 200, "the old credential holds"
        second = http.post("/v1/register", json={"role": "trainer", "rank": 0}).json()
        assert second["incarnation"] == first["incarnation"] + 1
        assert second["credential"] != first["credential"]
        r = http.post("/v1/leave", json={**body, "reason": "old process exits"})
        assert r.status_code == 409 and r.json()["error"] == "stale_incarnation", r.text
        r = http.post("/v1/heartbeat", json={**body, "incarnation": first["incarnation"]})
        assert r.status_code == 409 and r.json()["error"] == "stale_incarnation", r.text
        (t,) = http.get("/v1/status").json()["members"]
        assert t["state"] == "alive" and t["incarnation"] == second["incarnation"], t
