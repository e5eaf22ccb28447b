"""Forced tool calls, counted: N sampled requests whose tool_choice forces a call, each checked
to be one well-formed call valid against its tool's JSON schema.

    .venv/bin/python loadtests/agents_forced.py                  # starts the bundled SmolLM2
    .venv/bin/python loadtests/agents_forced.py --url http://127.0.0.1:8000 --requests 50

The requests cycle over three tools (a bounded string, integers with bounds and an enum, a
boolean and a nested object) and over the ways an agent forces a call: Chat Completions
`required` and a named function, Anthropic `any` and a named `tool`, Responses `required` and
a named function, each with parallel calls off (`parallel_tool_calls: false`, Anthropic's
`disable_parallel_tool_use`). They are sampled (temperature 1; chat with a seed each) with a
short max_tokens, run --concurrency at a time. The target (issue 24) is 100 %: every reply
one call of an allowed tool whose arguments satisfy the schema. It prints one line per
failure and the tally, writes --out/agents_forced.json, and exits 0 only when every request
passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agents_gate import ROOT, start_server, stop_server  # noqa: E402


def _fn(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties),
        "additionalProperties": False}}


FUNCTIONS = [
    _fn("read_file", "Read a file of the repository",
        {"path": {"type": "string", "maxLength": 24}}),
    _fn("resize", "Resize the terminal",
        {"rows": {"type": "integer", "minimum": 1, "maximum": 200},
         "cols": {"type": "integer", "minimum": 1, "maximum": 400},
         "unit": {"enum": ["chars", "pixels"]}}),
    _fn("set_flags", "Set the build flags",
        {"debug": {"type": "boolean"},
         "opt": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0,
                                                            "maximum": 3}},
                 "required": ["level"], "additionalProperties": False}}),
]
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}
ASK = ("Open README.md, make the terminal 40 by 120 characters, and turn debug on at "
       "optimisation level 2.")
# (surface, tool_choice): None names no tool ("required" / "any"), else the named tool. Every
# surface with every choice; the first six already have each surface unnamed and named, and
# each tool named once (the suite's short run).
_SURFACES = ("chat", "anthropic", "responses")
CHOICES = [(s, None) for s in _SURFACES] + [
    (s, f["name"]) for s, f in zip(_SURFACES, FUNCTIONS, strict=True)]
CHOICES += [(s, n) for s in _SURFACES for n in (None, *(f["name"] for f in FUNCTIONS))
            if (s, n) not in CHOICES]


def problems(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """What in `value` breaks `schema` (the keywords these schemas use)."""
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{where}: {value!r} not in the enum"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        out = [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            out += [f"{where}: unexpected {k}" for k in value if k not in props]
        for k, sub in props.items():
            if k in value:
                out += problems(value[k], sub, f"{where}.{k}")
        return out
    if kind == "string":
        if not isinstance(value, str):
            return [f"{where}: not a string"]
        return [f"{where}: longer than {schema['maxLength']}"] \
            if len(value) > schema.get("maxLength", len(value)) else []
    if kind == "integer":
        if type(value) is not int:
            return [f"{where}: not an integer"]
        low, high = schema.get("minimum", value), schema.get("maximum", value)
        return [] if low <= value <= high else [f"{where}: {value} out of [{low}, {high}]"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{where}: not a boolean"]
    return []


def check(name: str | None, arguments: Any, allowed: str | None) -> list[str]:
    if name is None:
        return ["no tool call"]
    if name not in SCHEMAS or (allowed is not None and name != allowed):
        return [f"called {name!r}"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return [f"arguments are not JSON ({exc}): {arguments!r}"]
    return problems(arguments, SCHEMAS[name])


async def one(http: httpx.AsyncClient, client: openai.AsyncOpenAI, i: int,
              args: argparse.Namespace) -> dict[str, Any]:
    surface, named = CHOICES[i % len(CHOICES)]
    # sampled: chat takes a seed (the others have no such field and draw one per request)
    sampling: dict[str, Any] = {"temperature": 1.0}
    calls: list[tuple[str, Any]] = []
    if surface == "chat":
        r = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": ASK}],
            tools=[{"type": "function", "function": f} for f in FUNCTIONS],
            tool_choice={"type": "function", "function": {"name": named}} if named
            else "required", parallel_tool_calls=False, max_tokens=args.max_tokens, seed=i,
            **sampling)
        calls = [(c.function.name, c.function.arguments)
                 for c in r.choices[0].message.tool_calls or []]
    elif surface == "responses":
        r2 = await client.responses.create(
            model="any", input=ASK, tools=[{"type": "function", **f} for f in FUNCTIONS],
            tool_choice={"type": "function", "name": named} if named else "required",
            parallel_tool_calls=False, max_output_tokens=args.max_tokens, **sampling)
        calls = [(o.name, o.arguments) for o in r2.output if o.type == "function_call"]
    else:
        resp = await http.post("/v1/messages", json={
            "model": "any", "max_tokens": args.max_tokens, **sampling,
            "messages": [{"role": "user", "content": ASK}],
            "tools": [{"name": f["name"], "description": f["description"],
                       "input_schema": f["parameters"]} for f in FUNCTIONS],
            "tool_choice": {"type": "tool", "name": named, "disable_parallel_tool_use": True}
            if named else {"type": "any", "disable_parallel_tool_use": True}})
        resp.raise_for_status()
        calls = [(b["name"], b["input"]) for b in resp.json()["content"]
                 if b["type"] == "tool_use"]
    # parallel calls are off on every surface: exactly one call, and every call valid
    found = [f"{len(calls)} calls"] if len(calls) > 1 else []
    for name, arguments in calls or [(None, None)]:
        found += check(name, arguments, named)
    name, arguments = calls[0] if calls else (None, None)
    return {"request": i, "surface": surface, "tool_choice": named or "required/any",
            "call": name, "arguments": arguments, "problems": found}


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=args.timeout)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as http:
        async def bounded(i: int) -> dict[str, Any]:
            async with sem:
                return await one(http, client, i, args)
        try:
            return list(await asyncio.gather(*(bounded(i) for i in range(args.requests))))
        finally:
            await client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start the bundled model)")
    p.add_argument("--model", help="the model to start (without --url)")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "agents_forced")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = (None, args.url) if args.url else start_server(args.model, args.concurrency,
                                                               args.out)
    try:
        results = asyncio.run(run(url.rstrip("/"), args))
    finally:
        if proc is not None:
            stop_server(proc)
    failed = [r for r in results if r["problems"]]
    for r in failed:
        print(f"FAIL request {r['request']} ({r['surface']}, {r['tool_choice']}): "
              f"{'; '.join(r['problems'])}")
    tools = sorted({r["call"] for r in results if r["call"]})
    print(f"{len(results) - len(failed)}/{len(results)} forced calls well-formed and "
          f"schema-valid; tools called: {', '.join(tools)}")
    (args.out / "agents_forced.json").write_text(json.dumps(
        {"passed": not failed, "requests": len(results), "failed": len(failed),
         "results": results}, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
