"""The request fields that ask for structured output, mapped onto StructuredOutputsParams.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields, in both endpoints. At most one constraint per request, as in vLLM.
``defaults`` are the server's ``--structured-outputs-config`` options (e.g.
``disable_any_whitespace``, ``max_whitespace_cnt``), which a request's own ``structured_outputs``
options override (``"max_whitespace_cnt": null`` asks for unbounded JSON whitespace).
"""

from __future__ import annotations

from typing import Any

from kvledger.errors import InvalidRequestError
from kvledger.structured.backends import BACKENDS, guidance_available, resolve_backend
from kvledger.structured.params import StructuredOutputsParams

_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "max_whitespace_cnt")
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_params(body: Any, defaults: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """The request's constraint, or None; InvalidRequestError naming a bad or doubled one."""
    options = {k: v for k, v in (defaults or {}).items() if k in _OPTIONS}
    found: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs must be an object")
        unknown = set(so) - set(StructuredOutputsParams.__dataclass_fields__) - {"_grammar"}
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown fields: {sorted(unknown)}")
        options.update({k: v for k, v in so.items() if k in _OPTIONS or k == "whitespace_pattern"})
        spec = {k: v for k, v in so.items() if k not in _OPTIONS and k != "whitespace_pattern" and v is not None}
        if spec:
            found.append(("structured_outputs", spec))
    for field, kind in GUIDED_FIELDS.items():
        v = getattr(body, field, None)
        if v is not None:
            found.append((field, {kind: v}))
    if getattr(body, "guided_json_object", None):
        found.append(("guided_json_object", {"json_object": True}))
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        options["whitespace_pattern"] = body.guided_whitespace_pattern
    server_backend = (defaults or {}).get("backend", "auto")
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend.split(":")[0] not in ("auto", server_backend):
        # vLLM's rule: the backend is the server's choice, not the request's.
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r}: request-level backend selection is not "
            f"supported; the server runs {server_backend!r} (--structured-outputs-config)"
        )
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(
            "only one kind of structured output may be requested; got "
            + ", ".join(name for name, _ in found)
        )
    name, spec = found[0]
    try:
        params = StructuredOutputsParams(**spec, **options)
        resolve_backend(params, server_backend)
        return params
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{name}: {e}") from None
    except TypeError as e:  # an unknown option name
        raise InvalidRequestError(f"{name}: {e}") from None


def _response_format(rf: Any) -> dict[str, Any] | None:
    if hasattr(rf, "model_dump"):
        rf = rf.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(rf, dict):
        raise InvalidRequestError("response_format must be an object")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            # OpenAI requires a schema; vLLM falls back to any JSON object. Refuse it clearly.
            raise InvalidRequestError("response_format json_schema needs json_schema.schema")
        return {"json": js["schema"]}
    if kind == "structural_tag":
        body = {k: v for k, v in rf.items() if k != "type"}
        import json

        return {"structural_tag": json.dumps({"type": "structural_tag", **body})}
    raise InvalidRequestError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag"
    )


def server_options(defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The StructuredOutputsParams options among the server's defaults."""
    return {k: v for k, v in (defaults or {}).items() if k in _OPTIONS}


def parse_structured_outputs_config(text: str | None) -> dict[str, Any]:
    """``--structured-outputs-config`` JSON (vLLM's flag): backend and default options."""
    import json

    from kvledger.errors import ConfigError

    if not text:
        return {}
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--structured-outputs-config is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--structured-outputs-config must be a JSON object")
    unknown = set(cfg) - {*_OPTIONS, "backend"}
    if unknown:
        raise ConfigError(
            f"--structured-outputs-config: unknown keys {sorted(unknown)}; known: backend, "
            + ", ".join(_OPTIONS)
        )
    cnt = cfg.get("max_whitespace_cnt", 1)
    if cnt is not None and (isinstance(cnt, bool) or not isinstance(cnt, int) or cnt < 1):
        raise ConfigError("--structured-outputs-config: max_whitespace_cnt must be a positive integer or null")
    backend = cfg.get("backend", "auto")
    if backend not in BACKENDS:
        raise ConfigError(f"--structured-outputs-config: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "guidance" and not guidance_available():
        raise ConfigError("--structured-outputs-config: the guidance backend needs llguidance (pip install llguidance)")
    return cfg
