"""A served model answers to several names: the served name, more names, and globs for the model ids agent CLIs
send by default (Claude Code's `claude-...`, Codex's `gpt-5...`), on every endpoint; other names stay a 404."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from cluster.launch.cli import _aliases
from cluster.topology import parse_topology
from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer


@pytest.fixture
def client():
    tok = load_tokenizer()
    app = create_app(FakeEngine(tok), tok, served_model_names=[MODEL, "qwen", "claude-*", "gpt-5*"])
    with TestClient(app) as c:
        yield c


def test_models_list_the_names_but_not_the_globs(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [MODEL, "qwen"]


@pytest.mark.parametrize("name", ["qwen", "claude-sonnet-4-5-20250929", "claude-haiku-4-5", "gpt-5.1-codex"])
def test_every_endpoint_answers_to_an_alias_and_echoes_it(client, name):
    chat = client.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == name
    messages = client.post("/v1/messages", json={"model": name, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 200 and messages.json()["model"] == name
    responses = client.post("/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 2})
    assert responses.status_code == 200 and responses.json()["model"] == name
    assert client.get(f"/v1/models/{name}").status_code == 200


@pytest.mark.parametrize("name", ["claude", "gpt-4o", "Qwen", "llama"])
def test_a_name_no_alias_matches_is_a_404_that_says_how_to_add_one(client, name):
    r = client.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "--served-model-name" in error["message"]


def test_aliases_come_from_the_flag_after_the_first_name_or_from_the_topology():
    topology = parse_topology('[model]\nserved_name = "m"\naliases = ["claude-*", "x"]\n', name="t")
    assert topology.model.aliases == ("claude-*", "x")
    assert _aliases(argparse.Namespace(served_model_name=None), topology) == ("claude-*", "x")
    assert _aliases(argparse.Namespace(served_model_name=["m", "gpt-5*"]), topology) == ("gpt-5*",)
    with pytest.raises(ValueError, match="aliases"):
        parse_topology('[model]\naliases = "claude-*"\n', name="t")
