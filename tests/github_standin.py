"""A stand-in for GitHub's REST API, for the notifier's tests: a real HTTP server on a local port
that checks every request against GitHub's official OpenAPI description (the npm package
@octokit/openapi, installed by .ci/run into .optdrift/npm) and answers from the same description.

Each request must match an operation of the description (method and path template); its path and
query parameters must satisfy their schemas (unknown query parameters are refused too, to catch a
misspelt one); its JSON body must satisfy the operation's requestBody schema. A request that does
not conform is answered 422 (as GitHub answers "Validation Failed") and recorded in `violations`.
Answers are the description's own examples for the operation, with the ids and fields the test
needs set from the stand-in's state (check runs, PR comments, pull requests).

Repository archives: GET /repos/{o}/{r}/tarball/{ref} answers GitHub's 302 to a second server, the
stand-in's download host (GitHub's codeload), which is not the REST API and so is not checked
against the description; it serves `tarballs` to a URL carrying its own short-lived token and
records every request's Authorization header (our credential must never reach it).

Tests can queue scripted failures (`fail_next`): a 403/429 with GitHub's rate-limit headers, or a
5xx, for the next request(s) to an operation, to prove the client's backoff and retries.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jsonschema

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where .ci/run installs the package (npm install --prefix .optdrift/npm @octokit/openapi@VERSION).
OCTOKIT_OPENAPI = REPO_ROOT / ".optdrift" / "npm" / "node_modules" / "@octokit" / "openapi"
SPEC_PATH = OCTOKIT_OPENAPI / "generated" / "api.github.com.json"
# Schema keywords of OpenAPI 3.0 that JSON Schema does not have (or that only annotate).
_OPENAPI_ONLY = ("nullable", "discriminator", "readOnly", "writeOnly", "xml", "externalDocs",
                 "example", "deprecated")


@lru_cache(maxsize=1)
def load_spec(path: Path = SPEC_PATH) -> dict[str, Any]:
    """The description, parsed once per test process (13 MB of JSON: about a second; a pickle of
    it was tried and loads no faster)."""
    return json.loads(path.read_text())


def _resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        pointer = node["$ref"].removeprefix("#/").split("/")
        node = spec
        for part in pointer:
            node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def to_json_schema(spec: dict[str, Any], node: Any, depth: int = 0) -> Any:
    """An OpenAPI 3.0 schema as a plain JSON Schema (draft 4): references inlined, `nullable`
    turned into a "null" type. Beyond a depth of 12 a schema is left open ({}): request bodies
    are shallow, and some response schemas refer to themselves."""
    if isinstance(node, list):
        return [to_json_schema(spec, item, depth) for item in node]
    if not isinstance(node, dict):
        return node
    if depth > 12:
        return {}
    node = _resolve(spec, node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _OPENAPI_ONLY or key.startswith("x-"):
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(spec, sub, depth + 1) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(spec, value, depth + 1)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(spec, sub, depth + 1) for sub in value]
        else:
            out[key] = value
    if node.get("nullable"):
        if "type" in out:
            types = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*types, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@dataclass
class Operation:
    method: str
    template: str
    operation_id: str
    definition: dict[str, Any]
    segments: tuple[str, ...]
    literal_segments: int

    def match(self, path: str) -> dict[str, str] | None:
        """The path parameters if `path` fits the template, segment by segment, else None."""
        parts = path.strip("/").split("/")
        if len(parts) != len(self.segments):
            return None
        values: dict[str, str] = {}
        for template, part in zip(self.segments, parts):
            # GitHub's templates put each parameter in a segment of its own ({owner}, {repo}).
            if template.startswith("{"):
                if not part:
                    return None
                values[template[1:-1]] = part
            elif template != part:
                return None
        return values


@lru_cache(maxsize=1)
def operations(path: Path = SPEC_PATH) -> list[Operation]:
    """Every operation of the description, most specific path first (literal segments win over
    parameters, as GitHub's router does: /issues/comments/{id} before /issues/{number}/comments)."""
    spec = load_spec(path)
    found = []
    for template, item in spec["paths"].items():
        segments = tuple(template.strip("/").split("/"))
        literal = sum(1 for part in segments if "{" not in part)
        for method, definition in item.items():
            if method in ("get", "post", "patch", "put", "delete"):
                found.append(Operation(method.upper(), template, definition["operationId"], definition,
                                       segments, literal))
    return sorted(found, key=lambda op: -op.literal_segments)


def _coerce(value: str, schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean":
            return {"true": True, "false": False}[value]
    except (ValueError, KeyError):
        return value  # left as text: the schema check reports it
    return value


def check_request(method: str, path: str, query: list[tuple[str, str]], body: bytes | None,
                  content_type: str | None) -> tuple[Operation | None, dict[str, Any], Any, list[str]]:
    """(operation, path parameters, parsed body, violations) of one request against the description."""
    spec = load_spec()
    matched = next(((op, values) for op in operations() if op.method == method
                    for values in [op.match(path)] if values is not None), None)
    if matched is None:
        return None, {}, None, [f"{method} {path}: no such operation in GitHub's REST description"]
    op, path_values = matched
    violations: list[str] = []
    parameters = [_resolve(spec, p) for p in op.definition.get("parameters", [])]
    known_query = {p["name"]: p for p in parameters if p["in"] == "query"}
    where = f"{op.operation_id} ({method} {op.template})"
    for parameter in parameters:
        schema = to_json_schema(spec, parameter.get("schema", {}))
        if parameter["in"] == "path":
            value = _coerce(path_values.get(parameter["name"], ""), schema)
            for error in jsonschema.Draft4Validator(schema).iter_errors(value):
                violations.append(f"{where}: path parameter {parameter['name']}={value!r}: {error.message}")
    query_values = dict(query)
    for name, raw in query_values.items():
        if name not in known_query:
            violations.append(f"{where}: unknown query parameter {name!r}")
            continue
        schema = to_json_schema(spec, known_query[name].get("schema", {}))
        for error in jsonschema.Draft4Validator(schema).iter_errors(_coerce(raw, schema)):
            violations.append(f"{where}: query parameter {name}={raw!r}: {error.message}")
    for name, parameter in known_query.items():
        if parameter.get("required") and name not in query_values:
            violations.append(f"{where}: required query parameter {name!r} missing")
    parsed = None
    request_body = op.definition.get("requestBody")
    if body:
        if request_body is None:
            violations.append(f"{where}: a body was sent, the operation takes none")
        elif not (content_type or "").startswith("application/json"):
            violations.append(f"{where}: body content type {content_type!r}, expected application/json")
        else:
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                violations.append(f"{where}: body is not JSON ({exc})")
    if request_body is not None and parsed is None and not violations:
        request_body = _resolve(spec, request_body)
        if request_body.get("required"):
            violations.append(f"{where}: the required JSON body is missing")
    if request_body is not None and parsed is not None:
        schema = to_json_schema(spec, _resolve(spec, request_body)["content"]["application/json"]["schema"])
        validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())
        for error in validator.iter_errors(parsed):
            location = "/".join(str(part) for part in error.absolute_path) or "(body)"
            violations.append(f"{where}: body {location}: {error.message}")
    return op, path_values, parsed, violations


def example_response(op: Operation, status: str) -> Any:
    """The description's first example of the operation's `status` answer."""
    spec = load_spec()
    content = _resolve(spec, op.definition["responses"][status]).get("content", {}).get("application/json", {})
    examples = content.get("examples", {})
    first = next(iter(examples.values()))
    return copy.deepcopy(_resolve(spec, first)["value"])


@dataclass
class Recorded:
    method: str
    path: str
    operation_id: str | None
    body: Any
    status: int
    at: float
    authorization: str | None


@dataclass
class ScriptedFailure:
    operation_id: str
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class StandinState:
    token: str | None = None
    app_public_key: str | None = None
    app_id: str | None = None
    installation_id: int = 4242
    installation_token: str = "ghs_standininstallationtoken000000000"
    next_id: int = 5_000_000_000  # past 2**32: the notifier must store GitHub's large ids
    check_runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    # issue number -> {comment id: body}
    comments: dict[int, dict[int, str]] = field(default_factory=dict)
    # commit sha -> [(PR number, head sha, state)]
    pulls: dict[str, list[tuple[int, str, str]]] = field(default_factory=dict)
    # PR number -> {"head_sha", "base_ref", "state", "mergeable", "merge_commit_sha"} (pulls/get)
    pull_details: dict[int, dict[str, Any]] = field(default_factory=dict)
    # commit sha -> its parents' shas (repos/get-commit)
    commit_parents: dict[str, list[str]] = field(default_factory=dict)
    # commit sha -> the tar.gz the download host serves for it
    tarballs: dict[str, bytes] = field(default_factory=dict)
    codeload_url: str = ""
    codeload_token: str = "standin-download-token-0123"
    # (path, Authorization header or None) of every request the download host got
    codeload_requests: list[tuple[str, str | None]] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    failures: list[ScriptedFailure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def calls(self, operation_id: str) -> list[Recorded]:
        return [r for r in self.requests if r.operation_id == operation_id]


class _Handler(BaseHTTPRequestHandler):
    state: StandinState  # set on the subclass the server makes

    def log_message(self, *_args: Any) -> None:  # quiet: the test reports what matters
        pass

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if payload is not None:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _authorized(self, op: Operation) -> bool:
        header = self.headers.get("Authorization") or ""
        scheme, _, credential = header.partition(" ")
        state = self.state
        if op.template.startswith("/app/") or op.operation_id == "apps/get-repo-installation":
            # App endpoints take the app's JWT (RS256, signed with its private key).
            if state.app_public_key is None or scheme.lower() != "bearer":
                return False
            import jwt

            try:
                claims = jwt.decode(credential, state.app_public_key, algorithms=["RS256"])
            except jwt.PyJWTError:
                return False
            return str(claims.get("iss")) == str(state.app_id)
        if scheme.lower() not in ("token", "bearer"):
            return False
        allowed = {state.token} if state.app_public_key is None else {state.installation_token}
        return credential in allowed

    def _handle(self) -> None:
        state = self.state
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        op, params, parsed, violations = check_request(self.command, url.path, parse_qsl(url.query),
                                                       body, self.headers.get("Content-Type"))
        with state.lock:
            record = Recorded(self.command, url.path, op.operation_id if op else None, parsed, 0,
                              time.monotonic(), self.headers.get("Authorization"))
            state.requests.append(record)
            if violations:
                state.violations.extend(violations)
                record.status = 422
                return self._send(422, {"message": "Validation Failed", "errors": violations})
            if not self._authorized(op):
                record.status = 401
                return self._send(401, {"message": "Bad credentials"})
            scripted = next((f for f in state.failures if f.operation_id == op.operation_id), None)
            if scripted is not None:
                state.failures.remove(scripted)
                record.status = scripted.status
                return self._send(scripted.status, scripted.body, scripted.headers)
            status, payload = self._answer(op, params, parsed or {})
            record.status = status
            if status == 302:  # a download: `payload` is where
                return self._send(302, None, {"Location": payload})
            self._send(status, payload)

    def _answer(self, op: Operation, params: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        state = self.state
        oid = op.operation_id
        if oid in ("checks/create", "checks/update"):
            if oid == "checks/create":
                run_id = state.new_id()
                state.check_runs[run_id] = {"head_sha": body["head_sha"], "name": body["name"]}
            else:
                run_id = int(params["check_run_id"])
                if run_id not in state.check_runs:
                    return 404, {"message": "Not Found"}
            run = state.check_runs[run_id]
            run.update({k: v for k, v in body.items()})
            answer = example_response(op, "201" if oid == "checks/create" else "200")
            answer.update(id=run_id, head_sha=run["head_sha"], name=run["name"],
                          status=run.get("status", "queued"), conclusion=run.get("conclusion"),
                          details_url=run.get("details_url"), external_id=run.get("external_id"))
            return (201 if oid == "checks/create" else 200), answer
        if oid == "repos/list-pull-requests-associated-with-commit":
            template = example_response(op, "200")[0]
            answer = []
            for number, head_sha, pr_state in state.pulls.get(params["commit_sha"], []):
                pull = copy.deepcopy(template)
                pull.update(number=number, state=pr_state)
                pull["head"]["sha"] = head_sha
                answer.append(pull)
            return 200, answer
        if oid == "issues/list-comments":
            number = int(params["issue_number"])
            query = dict(parse_qsl(urlsplit(self.path).query))
            per_page, page = int(query.get("per_page", 30)), int(query.get("page", 1))
            template = example_response(op, "200")[0]
            items = sorted(state.comments.get(number, {}).items())[(page - 1) * per_page: page * per_page]
            return 200, [{**copy.deepcopy(template), "id": cid, "body": text} for cid, text in items]
        if oid == "issues/create-comment":
            number = int(params["issue_number"])
            comment_id = state.new_id()
            state.comments.setdefault(number, {})[comment_id] = body["body"]
            return 201, {**example_response(op, "201"), "id": comment_id, "body": body["body"]}
        if oid == "issues/update-comment":
            comment_id = int(params["comment_id"])
            for comments in state.comments.values():
                if comment_id in comments:
                    comments[comment_id] = body["body"]
                    return 200, {**example_response(op, "200"), "id": comment_id, "body": body["body"]}
            return 404, {"message": "Not Found"}
        if oid == "pulls/get":
            pull = state.pull_details.get(int(params["pull_number"]))
            if pull is None:
                return 404, {"message": "Not Found"}
            answer = example_response(op, "200")
            answer.update(number=int(params["pull_number"]), state=pull["state"], mergeable=pull["mergeable"],
                          merge_commit_sha=pull["merge_commit_sha"])
            answer["head"]["sha"] = pull["head_sha"]
            answer["base"]["ref"] = pull["base_ref"]
            return 200, answer
        if oid == "repos/get-commit":
            parents = state.commit_parents.get(params["ref"])
            if parents is None:
                return 404, {"message": "Not Found"}
            answer = example_response(op, "200")
            template = answer["parents"][0]
            answer.update(sha=params["ref"], parents=[{**template, "sha": sha} for sha in parents])
            return 200, answer
        if oid == "repos/download-tarball-archive":
            if params["ref"] not in state.tarballs:
                return 404, {"message": "Not Found"}
            return 302, (f"{state.codeload_url}/{params['owner']}/{params['repo']}/legacy.tar.gz/{params['ref']}"
                         f"?token={state.codeload_token}")
        if oid == "apps/get-repo-installation":
            return 200, {**example_response(op, "200"), "id": state.installation_id}
        if oid == "apps/create-installation-access-token":
            if int(params["installation_id"]) != state.installation_id:
                return 404, {"message": "Not Found"}
            answer = example_response(op, "201")
            answer.update(token=state.installation_token,
                          expires_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600)))
            return 201, answer
        return 501, {"message": f"the stand-in does not answer {oid}"}


class _CodeloadHandler(BaseHTTPRequestHandler):
    """GitHub's download host: a tarball for a URL that carries the download token."""

    state: StandinState

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        with self.state.lock:
            self.state.codeload_requests.append((url.path, self.headers.get("Authorization")))
        sha = url.path.rsplit("/", 1)[-1]
        data = self.state.tarballs.get(sha)
        if dict(parse_qsl(url.query)).get("token") != self.state.codeload_token or data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-gzip")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class GitHubStandin:
    """Start with `with GitHubStandin(token=...) as github:`; `github.url` is the API base URL."""

    def __init__(self, *, token: str | None = None, app_id: str | None = None,
                 app_public_key: str | None = None) -> None:
        self.state = StandinState(token=token, app_id=app_id, app_public_key=app_public_key)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        codeload = type("CodeloadHandler", (_CodeloadHandler,), {"state": self.state})
        # Another origin than the API's (127.0.0.2: another host on the loopback network), as
        # codeload.github.com is another host than api.github.com.
        self.codeload = ThreadingHTTPServer(("127.0.0.2", 0), codeload)
        self.state.codeload_url = f"http://127.0.0.2:{self.codeload.server_address[1]}"
        self.codeload_thread = threading.Thread(target=self.codeload.serve_forever, daemon=True)

    def __enter__(self) -> "GitHubStandin":
        self.thread.start()
        self.codeload_thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        for server in (self.server, self.codeload):
            server.shutdown()
            server.server_close()

    def fail_next(self, operation_id: str, status: int, headers: dict[str, str] | None = None,
                  message: str = "scripted failure") -> None:
        self.state.failures.append(ScriptedFailure(operation_id, status, headers or {}, {"message": message}))
