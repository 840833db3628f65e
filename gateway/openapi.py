"""What the generated OpenAPI document cannot know by itself, completed in one place.

* Routes that read their body themselves (to name every bad field, SPEC §3) have no
  ``data`` parameter for Litestar to see: ``with_body`` gives their operations the
  request body schema of the same Struct.
* A kind's start route takes its params Struct (a component, with the kind's example
  body and description), so a client or a generated form can start a kind it has never
  seen. Results have the media types their kind declares; event routes answer
  ``text/event-stream`` (and ``/events`` also JSON, ``/jobs/{id}/output`` NDJSON, by ``Accept``).
* Every operation needs the bearer key except the public ones.
Problem responses are declared on the handlers with ``problems(...)``; each status is
described by the problem types ``schemas.problems`` gives it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Parameter,
    Reference,
    RequestBody,
    Schema,
    Tag,
)

from gateway.problems import PROBLEM_MEDIA_TYPE
from schemas import Problem
from schemas.problems import types_for_status
from schemas.events import ServerSentEvent
from herald.kinds import KindDeclaration as JobKind

PUBLIC_OPERATIONS = frozenset({"healthz", "readyz", "metrics", "portal_session"})
# Event streams only: a store outage is `retry:` and the end there (a 5xx would stop an EventSource).
STREAM_OPERATIONS = frozenset({"job_events", "webhook_events"})
BEARER: list[dict[str, list[str]]] = [{"bearer": []}]
# The /webhooks routes also take a portal session token (POST /portal/session).
BEARER_OR_PORTAL: list[dict[str, list[str]]] = [{"bearer": []}, {"portal": []}]

def _description(status: int) -> str:
    """The problem types an answer of this status can carry, from the one list of them."""
    carried = types_for_status(status)
    if not carried:
        raise ValueError(f"no problem type answers with status {status}: add it to schemas.problems")
    return "A problem: " + "; ".join(
        f"`{kind.type}` ({kind.title}{': ' + kind.note if kind.note else ''})" for kind in carried
    )


def problems(*codes: int) -> dict[int, ResponseSpec]:
    return {
        code: ResponseSpec(data_container=Problem, description=_description(code),
                           media_type=PROBLEM_MEDIA_TYPE, generate_examples=False)
        for code in codes
    }


# The Structs that hand-read bodies nest (a tenant's LimitsPatch, say): with_body refers to
# them under #/components/schemas, and complete_document puts them there.
_NESTED_SCHEMAS: dict[str, Any] = {}


def with_body(struct: type[msgspec.Struct], description: str) -> type[Operation]:
    """An ``operation_class`` whose request body is ``struct`` as JSON (for hand-read bodies)."""
    _refs, components = msgspec.json.schema_components([struct], ref_template="#/components/schemas/{name}")
    schema = components.pop(struct.__name__)
    _NESTED_SCHEMAS.update(components)

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = RequestBody(
                required=True,
                description=description,
                content={"application/json": OpenAPIMediaType(schema=schema)},  # type: ignore[arg-type]
            )

    return WithBody


def _sse_content() -> OpenAPIMediaType:
    (ref,), _components = msgspec.json.schema_components([ServerSentEvent], ref_template="#/components/schemas/{name}")
    return OpenAPIMediaType(schema=Reference(ref=ref["$ref"]))


def _describe_kinds(paths: Any, schemas: dict[str, Any], kinds: list[JobKind]) -> None:
    """Each kind's start operation: its params Struct as a component (nested types too),
    its example body, its description."""
    refs, components = msgspec.json.schema_components(
        [kind.params for kind in kinds], ref_template="#/components/schemas/{name}"
    )
    for name, component in components.items():
        if name in schemas and schemas[name] != component:
            raise ValueError(f"the params type {name} has the name of another schema in the API document: rename it")
        schemas[name] = component
    for kind, ref in zip(kinds, refs):
        start = paths[kind.collection].post
        assert start is not None
        example = dict(kind.example) if kind.example is not None else None
        start.request_body = RequestBody(
            required=True,
            description=f"The {kind.name} parameters ({kind.params.__name__})",
            content={"application/json": OpenAPIMediaType(schema=Reference(ref=ref["$ref"]), example=example)},
        )
        media = ", ".join(f"`{m}`" for m in kind.all_media_types)
        start.description = "\n\n".join(part for part in (
            kind.description,
            f"Answers 202 at once with the status object; poll `Location`, stream `links.events` or wait for a "
            f"webhook. Once succeeded, the result ({media}) is at `GET {kind.collection}/{{job_id}}`.",
        ) if part)


def complete_document(app: Litestar, kinds: Iterable[JobKind]) -> None:
    openapi = app.openapi_schema
    kinds = list(kinds)
    assert openapi.components is not None and openapi.paths is not None
    _refs, components = msgspec.json.schema_components([ServerSentEvent], ref_template="#/components/schemas/{name}")
    schemas = openapi.components.schemas if openapi.components.schemas is not None else {}
    # Plain JSON Schema dicts serialise as they are.
    schemas.update(components)  # type: ignore[arg-type]
    for name, nested in _NESTED_SCHEMAS.items():
        schemas.setdefault(name, nested)  # type: ignore[arg-type]
    openapi.components.schemas = schemas
    binary = Schema(type=OpenAPIType.STRING, format="binary")  # type: ignore[arg-type]

    openapi.tags = [*(openapi.tags or []), Tag(
        name="admin", description="The operator's API (SPEC §12): tenants, their scoped keys and limits, the audit "
        "log. Takes `Authorization: Bearer <HERALD_ADMIN_KEY>`; off (401) while that is unset.")]
    _describe_kinds(openapi.paths, schemas, kinds)
    json_result = Schema(description="the JSON value the handler returned")
    for kind in kinds:
        result = openapi.paths[f"{kind.collection}/{{job_id}}"].get
        assert result is not None and result.responses is not None
        result.responses["200"] = OpenAPIResponse(
            description=f"The {kind.name} result",
            content={media_type: OpenAPIMediaType(schema=json_result if media_type == "application/json" else binary)
                     for media_type in kind.all_media_types},
        )
        # A part of the result is bytes, whatever the whole is (a part of JSON is no JSON).
        result.responses["206"] = OpenAPIResponse(
            description="The one byte range asked for (`Range`)",
            content={media_type: OpenAPIMediaType(schema=binary) for media_type in kind.all_media_types},
        )

    sse = _sse_content()
    job_stream = openapi.paths["/jobs/{job_id}/events"].get
    tenant_stream = openapi.paths["/events"].get
    assert job_stream is not None and tenant_stream is not None
    assert job_stream.responses is not None and tenant_stream.responses is not None
    job_stream.responses["200"] = OpenAPIResponse(description="The job's events", content={"text/event-stream": sse})
    feed = tenant_stream.responses["200"]
    assert isinstance(feed, OpenAPIResponse) and feed.content is not None
    feed.content["text/event-stream"] = sse

    output_stream = openapi.paths["/jobs/{job_id}/output"].get
    assert output_stream is not None and output_stream.responses is not None
    ndjson_line = Schema(type=OpenAPIType.OBJECT, required=["n", "data"], properties={
        "n": Schema(type=OpenAPIType.INTEGER, minimum=1, description="the chunk's number, 1, 2, 3… per job"),
        "data": Schema(description="the chunk, as the handler emitted it (any JSON value)"),
    }, description="one line per chunk")
    output_stream.responses["200"] = OpenAPIResponse(
        description="With Accept: text/event-stream, the chunks as `id: <n>`, `event: output`, live, then, once the "
        "job ended, one event named by its terminal event type (`job.succeeded`…) with the final status object, "
        "whose `id:` is the last chunk's number (0 without chunks: resuming there is `204`); otherwise the chunks "
        "so far, one JSON object per line",
        content={"text/event-stream": sse, "application/x-ndjson": OpenAPIMediaType(schema=ndjson_line)})

    webhook_stream = openapi.paths["/webhooks/events"].get
    assert webhook_stream is not None and webhook_stream.responses is not None
    webhook_stream.responses["200"] = OpenAPIResponse(
        description="Notices that the tenant's deliveries changed", content={"text/event-stream": sse})

    _describe_headers(openapi.paths, kinds)
    schemas["ProblemAnswer"] = _PROBLEM_ANSWER  # type: ignore[assignment]
    for path, item in openapi.paths.items():
        for operation in (item.get, item.post, item.put, item.patch, item.delete):
            if operation is None:
                continue
            if operation.request_body is not None:
                _problem_response(operation, 413)  # any body over 1 MiB (SPEC §10)
                _problem_response(operation, 408)  # a body that stops arriving (gateway/bodies.py)
            if operation.operation_id not in PUBLIC_OPERATIONS | STREAM_OPERATIONS:
                # The store (PostgreSQL) unreachable, or the keys it holds not loaded yet.
                _problem_response(operation, 503)
            _problems_everywhere(operation)
            _canonical_header_names(operation)
            _answer_headers(operation, {"429": {"Retry-After": _RETRY_AFTER}, "503": {"Retry-After": _RETRY_AFTER}})
            if operation.operation_id not in PUBLIC_OPERATIONS:
                # Every key-protected route can refuse a missing key and a key without its scope.
                _problem_response(operation, 401)
                _problem_response(operation, 403)
                _answer_headers(operation, {"401": {"WWW-Authenticate": _WWW_AUTHENTICATE}})
                if path.startswith("/admin"):
                    operation.security = [{"admin": []}]
                    continue
                security = BEARER_OR_PORTAL if path.startswith("/webhooks") else BEARER
                operation.security = security  # type: ignore[assignment]


# An answer's problem always carries `status` and `detail` (SPEC §10); `Problem` itself is also
# a failed job's `error`, which has no status.
_PROBLEM_ANSWER = {
    "description": "An RFC 9457 problem answering a request: `type` (relative, under /problems/), `title`, "
                   "`status`, `detail`, and for an invalid request or cursor `errors` naming each bad field",
    "allOf": [{"$ref": "#/components/schemas/Problem"}],
    "properties": {"status": {"type": "integer", "minimum": 400, "maximum": 599}, "detail": {"type": "string"}},
    "required": ["type", "title", "status", "detail"],
}


def _problem_answer(status: int) -> OpenAPIResponse:
    return OpenAPIResponse(description=_description(status), content={
        PROBLEM_MEDIA_TYPE: OpenAPIMediaType(schema=Reference(ref="#/components/schemas/ProblemAnswer"))})


def _problem_response(operation: Operation, status: int) -> None:
    responses = operation.responses if operation.responses is not None else {}
    responses.setdefault(str(status), _problem_answer(status))
    operation.responses = responses


def _problems_everywhere(operation: Operation) -> None:
    """Litestar documents its own 400 (a parameter it validates) as its exception's JSON; the
    gateway answers every error as problem+json (gateway/problems.py), with every member."""
    for status, response in (operation.responses or {}).items():
        if status.startswith(("4", "5")) and isinstance(response, OpenAPIResponse):
            answer = _problem_answer(int(status))
            answer.headers = response.headers  # what a handler's ResponseSpec documented stays
            if response.content is not None and PROBLEM_MEDIA_TYPE in response.content:
                answer.description = response.description
            operation.responses[status] = answer  # type: ignore[index]


_TEXT = Schema(type=OpenAPIType.STRING)
_SECONDS = Schema(type=OpenAPIType.INTEGER, minimum=1)
_RETRY_AFTER = OpenAPIHeader(schema=_SECONDS, description="seconds to wait before asking again")
_LOCATION = OpenAPIHeader(schema=_TEXT, description="the resource this answer names")
_ETAG = OpenAPIHeader(schema=_TEXT, description='the status version as a weak tag, `W/"<version>"`: send it as '
                      "`If-None-Match` to get `304` while nothing changed")
_RESULT_ETAG = OpenAPIHeader(schema=_TEXT, description='the result\'s strong tag, `"<job id>-<attempt>"` (a result '
                             "never changes): send it as `If-None-Match` to get `304`")
_NO_STORE = OpenAPIHeader(schema=_TEXT, description="`no-store`")
_WWW_AUTHENTICATE = OpenAPIHeader(schema=_TEXT, description='`Bearer realm="herald"`: send `Authorization: Bearer '
                                  "<key>`")
_ATTACHMENT = OpenAPIHeader(schema=_TEXT, description="`attachment; filename=\"<kind>-<job id><suffix>\"`")
_CACHE_RESULT = OpenAPIHeader(schema=_TEXT, description="`private, no-cache` with a key (revalidated by the ETag); "
                              "with a signed URL `private, max-age=<seconds until its exp>`")
_ACCEPT_RANGES = OpenAPIHeader(schema=_TEXT, description="`bytes`: one range of the result may be asked for (`Range`)")
_CONTENT_RANGE = OpenAPIHeader(schema=_TEXT, description="`bytes <first>-<last>/<size>`: the part sent")
_UNSATISFIED_RANGE = OpenAPIHeader(schema=_TEXT, description="`bytes */<size>`: the result's size")
_REPLAYED = OpenAPIHeader(schema=Schema(type=OpenAPIType.STRING, enum=["true"]),
                          description="`true` when this answers an Idempotency-Key seen before: the same job again")


def _request_header(name: str, description: str) -> Parameter:
    return Parameter(name=name, param_in="header", schema=_TEXT, description=description)


def _answer_headers(operation: Operation, by_status: dict[str, dict[str, OpenAPIHeader]]) -> None:
    for status, headers in by_status.items():
        response = (operation.responses or {}).get(status)
        if isinstance(response, OpenAPIResponse):
            response.headers = {**(response.headers or {}), **headers}


def _canonical_header_names(operation: Operation) -> None:
    """A route's ``cache_control=`` reaches the document as ``cache-control``; every other header
    is named as the SPEC writes it, so a client reading the document sees one spelling."""
    for response in (operation.responses or {}).values():
        if isinstance(response, OpenAPIResponse) and response.headers and "cache-control" in response.headers:
            response.headers = {("Cache-Control" if name == "cache-control" else name): header
                                for name, header in response.headers.items()}


def _add_parameters(operation: Operation, *parameters: Parameter) -> None:
    known = {p.name for p in operation.parameters or () if isinstance(p, Parameter)}
    operation.parameters = [*(operation.parameters or ()), *(p for p in parameters if p.name not in known)]


def _describe_headers(paths: Any, kinds: list[JobKind]) -> None:
    """The headers SPEC §3, §4 and §8 give meaning to, which Litestar cannot see: the routes
    read and write them themselves."""
    for kind in kinds:
        start = paths[kind.collection].post
        _answer_headers(start, {"202": {"Location": _LOCATION, "Retry-After": _RETRY_AFTER, "Cache-Control": _NO_STORE,
                                        "Idempotent-Replayed": _REPLAYED}})
        _add_parameters(start, _request_header(
            "Idempotency-Key", "1..255 printable ASCII characters (a UUID is best): a retry with the same key and "
            "body answers the same job again (`Idempotent-Replayed: true`); another body, `422`"), _request_header(
            "traceparent", "W3C Trace Context: the job joins that trace"))
    status = paths["/jobs/{job_id}"].get
    _answer_headers(status, {"200": {"ETag": _ETAG, "Retry-After": _RETRY_AFTER, "Cache-Control": _NO_STORE},
                             "303": {"Location": _LOCATION, "ETag": _ETAG, "Cache-Control": _NO_STORE},
                             # A 304 carries what its 200 would (RFC 9110 §15.4.5), as answer_response sends it.
                             "304": {"ETag": _ETAG, "Retry-After": _RETRY_AFTER, "Cache-Control": _NO_STORE}})
    _answer_headers(paths["/jobs/{job_id}"].delete, {"200": {"Cache-Control": _NO_STORE},
                                                     "202": {"Cache-Control": _NO_STORE}})
    _add_parameters(status, _request_header("If-None-Match", "a tag this route gave: `304` while it is current "
                                            "(with `wait`, held until it is not)"))
    for kind in kinds:
        result = paths[f"{kind.collection}/{{job_id}}"].get
        _answer_headers(result, {
            "200": {"ETag": _RESULT_ETAG, "Content-Disposition": _ATTACHMENT, "Cache-Control": _CACHE_RESULT,
                    "Accept-Ranges": _ACCEPT_RANGES},
            "206": {"Content-Range": _CONTENT_RANGE, "ETag": _RESULT_ETAG, "Content-Disposition": _ATTACHMENT,
                    "Cache-Control": _CACHE_RESULT, "Accept-Ranges": _ACCEPT_RANGES},
            "304": {"ETag": _RESULT_ETAG, "Cache-Control": _CACHE_RESULT},
            "416": {"Content-Range": _UNSATISFIED_RANGE},
            "404": {"Retry-After": OpenAPIHeader(schema=_SECONDS, description="with `/problems/result-not-ready`: "
                                                 "seconds until it is worth asking again")}})
        _add_parameters(result, _request_header("If-None-Match", "the result's ETag: `304` (a result never changes)"),
                        _request_header("Range", "one range, `bytes=<first>-<last>`, `bytes=<first>-` or `bytes=-<n>`: "
                                        "`206` with that part (several ranges, or another unit: the whole, `200`); "
                                        "starting past the end: `416`"),
                        _request_header("If-Range", "the result's ETag: the `Range` is honoured only while it is "
                                        "current (any other value: the whole result)"))
    for path in ("/jobs/{job_id}/events", "/events", "/jobs/{job_id}/output"):
        _add_parameters(paths[path].get, _request_header(
            "Last-Event-ID", "resume after this event id (as `?last_event_id=`; the header wins)"))
    for path in ("/jobs/{job_id}/events", "/events", "/jobs/{job_id}/output", "/webhooks/events"):
        _answer_headers(paths[path].get, {"200": {"Cache-Control": _NO_STORE}})
    created = paths["/webhooks"].post
    _answer_headers(created, {"201": {"Location": _LOCATION}})
    _answer_headers(paths["/admin/tenants"].post, {"201": {"Location": _LOCATION}})
