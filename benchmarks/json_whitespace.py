"""JSON that never runs away: how many json_schema answers validate on stories260k, per
whitespace bound (StructuredOutputsParams.max_whitespace_cnt; None = unbounded, xgrammar's
default and what vLLM runs), and with disable_any_whitespace.

    python -m benchmarks.json_whitespace [--model ../shared/models/stories260k]
        [--bounds none,1,2,4,8] [--samples 4] [--max-tokens 120] [--backend auto]

The schemas are small objects (strings with maxLength, bounded integers, enums, booleans,
nested objects) that the tests do not contain. Each schema is asked for with two prompts at
temperature 0, and ``--samples`` seeds at temperature 1. An answer counts when it parses,
validates against its schema and finished by itself (not at max_tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema

S6 = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 1, "maximum": 12}}, "required": ["hero", "age"]},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "sleepy"]}, "brave": {"type": "boolean"}}, "required": ["mood", "brave"]},
    {"type": "object", "properties": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}}, "required": ["kind", "legs"]}, "name": S6}, "required": ["pet", "name"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "pages": {"type": "integer", "minimum": 1, "maximum": 300}, "read": {"type": "boolean"}}, "required": ["title", "pages", "read"]},
    {"type": "object", "properties": {"a": S6, "b": S6, "c": S6}, "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"place": {"type": "object", "properties": {"town": S6, "far": {"type": "boolean"}}, "required": ["town", "far"]}, "day": {"enum": ["mon", "tue", "sun"]}}, "required": ["place", "day"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -50, "maximum": 50}, "ok": {"type": "boolean"}}, "required": ["score", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"friend": S6, "toy": {"type": "string", "maxLength": 9}, "size": {"enum": ["big", "small"]}}, "required": ["friend", "toy", "size"]},
    {"type": "object", "properties": {"outer": {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}, "required": ["inner"]}}, "required": ["outer"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}, "label": S6}, "required": ["colour", "count", "label"]},
]
PROMPTS = ["Once upon a time", "Lily wanted a pet. The pet was"]


def _ok(text: str, finish: str | None, schema: dict) -> bool:
    if finish != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260k"))
    ap.add_argument("--bounds", default="none,1,2,4,8")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()

    from kvledger import LLM, SamplingParams
    from kvledger.structured.params import StructuredOutputsParams

    llm = LLM(args.model, structured_outputs_config={"backend": args.backend})
    configs: list[tuple[str, dict]] = []
    for b in args.bounds.split(","):
        configs.append((f"max_whitespace_cnt={b}", {"max_whitespace_cnt": None if b == "none" else int(b)}))
    configs.append(("disable_any_whitespace", {"disable_any_whitespace": True}))
    print(f"model {args.model}, {len(SCHEMAS)} schemas, max_tokens {args.max_tokens}, backend {args.backend}")
    print(f"{'grammar':<26} {'T=0 valid':>10} {'T=1 valid':>10} {'mean tokens':>12}")
    for label, opts in configs:
        counts = {0.0: [0, 0], 1.0: [0, 0]}
        tokens = []
        for schema in SCHEMAS:
            so = {"json": schema, **opts}
            jobs = [(p, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(**so))) for p in PROMPTS]
            jobs += [(PROMPTS[s % len(PROMPTS)], SamplingParams(temperature=1.0, seed=s, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(**so))) for s in range(args.samples)]
            outs = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs], use_tqdm=False)
            for (_, sp), out in zip(jobs, outs):
                c = out.outputs[0]
                counts[sp.temperature][1] += 1
                counts[sp.temperature][0] += _ok(c.text, c.finish_reason, schema)
                tokens.append(len(c.token_ids))
        t0, t1 = counts[0.0], counts[1.0]
        print(f"{label:<26} {t0[0]:>4}/{t0[1]:<5} {t1[0]:>4}/{t1[1]:<5} {sum(tokens) / len(tokens):>12.1f}", flush=True)


if __name__ == "__main__":
    main()
