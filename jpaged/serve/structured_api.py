"""Structured-output request fields, as OpenAI and vLLM spell them, read into one
`StructuredOutputsParams` and compiled while the request is validated (on the server's worker
threads: a malformed schema or grammar is a 400 naming the field, and the engine's thread finds
the constraint compiled).

    response_format: {"type": "text"} (none), {"type": "json_object"},
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar: vLLM's older names
    tools (with tool_choice "required" or a named function): the calls' schema (tools_api)
"""

from jpaged.serve.errors import APIError
from jpaged.structured_outputs import KINDS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs(body: dict, constraints,
                       tool_schema: dict | None = None) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained), compiled with `constraints` (the engine's
    `ConstraintCompiler`) so that a bad one is refused here; APIError naming the field.
    tool_schema: the JSON schema the request's tool_choice forces (tools_api)."""
    found = [(name, value) for name, value in _sources(body) if value is not None]
    if tool_schema is not None:
        found.append(("tools", {"json": tool_schema}))
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise APIError(f"give at most one output constraint, got {names}", param=found[1][0])
    if not found:
        return None
    field, fields = found[0]
    if constraints is None:
        raise APIError("this server cannot compile output constraints", param=field)
    try:
        params = StructuredOutputsParams(**fields)
        constraints.constraint(params)
    except ValueError as err:
        raise APIError(f"'{field}': {err}", param=field) from err
    return params


def _sources(body: dict):
    """(field, StructuredOutputsParams fields or None) for each field that can constrain."""
    yield "response_format", _response_format(body.get("response_format"))
    value = body.get("structured_outputs")
    if value is not None:
        if not isinstance(value, dict):
            raise APIError("'structured_outputs' must be an object", param="structured_outputs")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise APIError(f"'structured_outputs' has unknown fields {unknown}; it takes one of "
                           f"{list(KINDS)}", param="structured_outputs")
        value = {kind: item for kind, item in value.items() if item is not None}
    yield "structured_outputs", value or None
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            yield name, {kind: body[name]}


def _response_format(value) -> dict | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError("'response_format' of type json_schema needs 'json_schema': "
                           "{\"name\": ..., \"schema\": {...}}", param="response_format")
        return {"json": spec["schema"]}
    raise APIError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                   "or {\"type\": \"json_schema\", \"json_schema\": {...}}",
                   param="response_format")
