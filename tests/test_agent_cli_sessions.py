"""The real agent CLIs, configured only as README.md's "Agent CLIs" recipe says, complete a session against
`mlx-pd serve`: Claude Code 2.1.332 (`claude -p`) over the Anthropic Messages API and Codex 0.171.0
(`codex exec`) over the Responses API.

The server runs a random-weight llama with a 131072-token context (tests/agent_cli_helpers.py: SmolLM2's
tokenizer and chat template; its end-of-turn token wins greedy decoding wherever it is allowed, so answers end
instead of running into the token limit, which both CLIs report as a failed session). A random model never
calls a tool on its own, so a small proxy between CLI and server (`ForcingProxy`) changes the traffic in three
ways and no other:

- the first model request that offers the chosen tool gets `tool_choice` forcing a call of it (Anthropic
  `{"type": "tool", "name": ...}`, Responses `{"type": "function", "name": ...}`): Claude Code's `ListAgents`
  and Codex's `get_goal`, tools without required arguments that the CLIs run read-only, so the forced call
  is complete after `{}`;
- every model request's `max_tokens` / `max_output_tokens` is capped (a safety net: a model that did not end
  its turn would write until the context is full);
- every model request gets `temperature` 0 (greedy: the same session every run).

Each test runs its CLI once with a one-line prompt in a fresh working folder and HOME, with a deadline, and
checks that the CLI exits 0, that every request the server saw was answered 200 (the one exception: Claude
Code's `HEAD /api/hello` connectivity probe, a 404 it ignores), that the server answered the forced request
with a call of the tool, and that the CLI ran the tool and sent its result back (a `tool_result` block for the
call's id / a `function_call_output` item for its call_id) in a request the server answered too, ending the
turn normally.

The CLIs come from scripts/agents/install (into $MLXPD_AGENT_CLIS, by default ~/.cache/mlx-pd/agent-clis; .ci/run
installs them): without them these tests skip, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.agent_cli_helpers import (CONTEXT, ForcingProxy, agent_cli, cli_env, log, long_context_model_dir, run_cli,
                                     serve)

MODEL = "llama-131k"  # the served name; 'claude-*' is an alias, for the model ids Claude Code sends by default
CLI_DEADLINE = 240  # seconds one CLI session may take (about 35 s for Claude Code here, 6 s for Codex)
MAX_TOKENS = 64
CLAUDE_TOOL, CODEX_TOOL = "ListAgents", "get_goal"
CLAUDE_PROMPT = "List the agents you can message."
CODEX_PROMPT = "What is the current goal?"
TOLERATED = {("HEAD", "/api/hello"): 404}  # Claude Code's connectivity probe; it goes on after a 404

pytestmark = pytest.mark.timeout(2 * CLI_DEADLINE + 180)


@pytest.fixture(scope="module")
def claude() -> Path:
    return agent_cli("claude")


@pytest.fixture(scope="module")
def codex() -> Path:
    return agent_cli("codex")


@pytest.fixture(scope="module")
def server() -> str:
    """`mlx-pd serve --model FOLDER --served-model-name llama-131k 'claude-*'`, as the README's recipe starts it.
    The KV pool (0.25 GiB: 512 KiB per 1,024 tokens for this model) holds several whole 131072-token contexts."""
    start = time.monotonic()
    folder = long_context_model_dir()
    with serve(folder, MODEL, ("claude-*",), kv_cache_gb=0.25) as base:
        log(f"agent CLI server up in {time.monotonic() - start:.1f} s (model folder and start)")
        yield base


def sse_events(stream: bytes) -> list[dict]:
    """The JSON `data:` payloads of an SSE answer, in order."""
    events = []
    for line in stream.decode("utf-8", "replace").splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            events.append(json.loads(line[5:]))
    return events


def check_session(proxy: ForcingProxy, run, what: str) -> None:
    """The CLI exited 0 and every request was answered 200 (or as `TOLERATED` says)."""
    details = f"{what} session ({run.seconds:.1f} s), requests:\n{proxy.report()}\noutput tail:\n{run.output[-3000:]}"
    assert run.returncode == 0, f"the CLI exited {run.returncode}; " + details
    for exchange in proxy.exchanges:
        allowed = TOLERATED.get((exchange.method, exchange.path.split("?")[0]), 200)
        assert exchange.status in (200, allowed), f"{exchange.summary()}; " + details
    assert proxy.forced, "no model request offered the tool to force; " + details
    log(f"{what}: exit 0 in {run.seconds:.1f} s\n{proxy.report()}")


def time_of_requests(proxy: ForcingProxy) -> str:
    return ", ".join(f"{e.seconds:.1f} s" for e in proxy.model_requests())


@pytest.mark.parametrize("model_env", [None, MODEL], ids=["alias", "ANTHROPIC_MODEL"])
def test_claude_code_runs_a_tool_and_sends_its_result_back(server, claude, tmp_path, model_env):
    """Claude Code with ANTHROPIC_BASE_URL, a dummy ANTHROPIC_API_KEY and CLAUDE_CODE_AUTO_COMPACT_WINDOW set to
    the served context (this short session never reaches it), sending its own default model id
    (served through the 'claude-*' alias) or, with ANTHROPIC_MODEL, the served name (it then asks for another
    max_tokens and effort): its forced ListAgents call comes back as a tool_result the server answers."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    extra = {"ANTHROPIC_MODEL": model_env} if model_env else {}
    with ForcingProxy(server, CLAUDE_TOOL, MAX_TOKENS) as proxy:
        env = cli_env(home, ANTHROPIC_BASE_URL=proxy.base_url, ANTHROPIC_API_KEY="unused",
                      CLAUDE_CODE_AUTO_COMPACT_WINDOW=str(CONTEXT), **extra)
        run = run_cli([str(claude), "-p", CLAUDE_PROMPT], env, work, CLI_DEADLINE)
    check_session(proxy, run, "Claude Code")
    calls = proxy.model_requests()
    first = next(i for i, e in enumerate(calls) if any(r.startswith("tool_choice=") for r in e.rewritten))
    assert len(calls) > first + 1, "no request after the forced call:\n" + proxy.report()
    forced, follow_up = calls[first], calls[first + 1]
    if model_env:
        assert forced.body["model"] == model_env

    # The server answered the forced request with one call of the tool, and the turn stopped for it.
    events = sse_events(forced.answer)
    uses = [e["content_block"] for e in events
            if e.get("type") == "content_block_start" and e["content_block"].get("type") == "tool_use"]
    assert [u["name"] for u in uses] == [CLAUDE_TOOL], events
    stops = [e["delta"].get("stop_reason") for e in events if e.get("type") == "message_delta"]
    assert stops == ["tool_use"], events

    # The next request carries the CLI's result of that call (not an error), and the server answered it with a
    # turn that ended normally.
    results = [block for message in follow_up.body["messages"] if isinstance(message.get("content"), list)
               for block in message["content"] if block.get("type") == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [uses[0]["id"]], follow_up.body["messages"][-2:]
    assert not results[0].get("is_error"), results
    assert results[0]["content"], results
    follow_stops = [e["delta"].get("stop_reason") for e in sse_events(follow_up.answer)
                    if e.get("type") == "message_delta"]
    assert follow_stops == ["end_turn"], follow_up.answer[-2000:]
    log(f"Claude Code ({'ANTHROPIC_MODEL' if model_env else 'alias'}): model requests took {time_of_requests(proxy)}; "
        f"first prompt {forced.prompt_tokens} tokens")


def codex_config(base_url: str, extra: tuple[str, ...] = ()) -> str:
    """README.md's config.toml for Codex, with `base_url` the server's address + /v1 (and `extra` top-level lines)."""
    return "\n".join([
        f'model = "{MODEL}"',
        'model_provider = "mlxpd"',
        f"model_context_window = {CONTEXT}",
        *extra,
        "",
        "[model_providers.mlxpd]",
        'name = "mlx-pd"',
        f'base_url = "{base_url}/v1"',
        'env_key = "MLXPD_API_KEY"',
        'wire_api = "responses"',
        "",
    ])


def codex_session(server: str, codex: Path, tmp_path: Path, extra: tuple[str, ...] = ()) -> ForcingProxy:
    """One `codex exec` session through a ForcingProxy (get_goal forced); checks it (`check_session`) and checks
    that the server answered the forced request with one completed call of get_goal, whose output Codex sent
    back in the next request, which the server answered with a completed response. Returns the proxy."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    with ForcingProxy(server, CODEX_TOOL, MAX_TOKENS) as proxy:
        (codex_home / "config.toml").write_text(codex_config(proxy.base_url, extra))
        env = cli_env(home, CODEX_HOME=str(codex_home), MLXPD_API_KEY="unused")
        run = run_cli([str(codex), "exec", "--skip-git-repo-check", CODEX_PROMPT], env, work, CLI_DEADLINE)
    check_session(proxy, run, "Codex")
    calls = proxy.model_requests()
    assert len(calls) >= 2, proxy.report()
    forced, follow_up = calls[0], calls[1]
    assert forced.body["model"] == MODEL
    assert any(r.startswith("tool_choice=") for r in forced.rewritten), proxy.report()

    # The server answered the forced request with one completed call of the tool.
    events = sse_events(forced.answer)
    items = [e["item"] for e in events if e.get("type") == "response.output_item.done"]
    assert [(i["type"], i["name"]) for i in items] == [("function_call", CODEX_TOOL)], items
    assert events[-1]["type"] == "response.completed", events[-1]

    # The next request carries Codex's output of that call, and the server answered it with a completed response.
    outputs = [i for i in follow_up.body["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [items[0]["call_id"]], follow_up.body["input"][-3:]
    assert "goal" in json.loads(outputs[0]["output"]), outputs  # get_goal's answer: no goal set in a fresh HOME
    last = sse_events(follow_up.answer)[-1]
    assert last["type"] == "response.completed" and last["response"]["status"] == "completed", last
    log(f"Codex: model requests took {time_of_requests(proxy)}; first prompt {forced.prompt_tokens} tokens")
    return proxy


def test_codex_runs_a_tool_and_sends_its_result_back(server, codex, tmp_path):
    """Codex with a config.toml whose custom provider points at the server (wire_api "responses", model = the
    served name, env_key naming a variable with a dummy key): its forced get_goal call comes back as a
    function_call_output the server answers, and the turn ends there."""
    proxy = codex_session(server, codex, tmp_path)
    assert len(proxy.model_requests()) == 2, proxy.report()


def request_kind(exchange) -> str:
    """What Codex says a Responses request is for ("turn", "compaction"): its client_metadata's turn metadata."""
    metadata = json.loads((exchange.body.get("client_metadata") or {}).get("x-codex-turn-metadata") or "{}")
    return metadata.get("request_kind", "?")


def test_codex_compacts_a_turn_locally_and_goes_on(server, codex, tmp_path):
    """The README's Codex configuration plus `model_auto_compact_token_limit = 2000`, below its ~9k-token first
    prompt, so that Codex compacts in the middle of the turn, after the tool result: a provider of one's own gets
    local compaction, an ordinary Responses request (no tools, `tool_choice` "auto") that asks the model for a
    handoff summary. The server answers it like any other, and Codex goes on with the compacted history (its
    summary message in place of the tool call), which the server answers too."""
    proxy = codex_session(server, codex, tmp_path, extra=("model_auto_compact_token_limit = 2000",))
    calls = proxy.model_requests()
    kinds = [request_kind(e) for e in calls]
    assert kinds == ["turn", "compaction", "turn"], proxy.report()
    compaction, after = calls[1], calls[2]
    assert compaction.body["tools"] == [] and compaction.body["tool_choice"] == "auto", compaction.body["tools"]
    assert "COMPACTION" in json.dumps(compaction.body["input"][-1]), compaction.body["input"][-1]
    # After the compaction the history no longer holds the call and its output, only messages.
    assert {i.get("type") for i in after.body["input"]} == {"message"}, after.body["input"]
    assert sse_events(after.answer)[-1]["type"] == "response.completed", after.answer[-2000:]
