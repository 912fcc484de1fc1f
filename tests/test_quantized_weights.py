"""`mlx-pd serve` on MLX model folders in the formats mlx-lm's converter writes (4-bit and 8-bit quantized
weights, bfloat16 weights) gives mlx-lm's own greedy generation on the same folder.

The folders are made here, once per module, into a pytest tmp folder, by mlx-lm's own converter from the
imported default model (SmolLM2-135M-Instruct, float32): `mlx_lm.convert(quantize=True, q_bits=4 or 8,
q_group_size=64)`, which keeps the float32 dtype for the scales, biases and norms, and
`mlx_lm.convert(dtype="bfloat16")`. Each folder is served at the dtype it holds (float32 for the quantized
ones, `--dtype bfloat16` for the bfloat16 one), since `load_model` casts every float weight to the server's
dtype and mlx-lm computes in the folder's own.

The server is the real one, not an engine driven in-process: `tests.live_server.live_model_server` starts it
as `mlx-pd serve --model FOLDER` does (`start_single_node_engine`: the folder's config check, `load_model` at
the chosen dtype, the engine in the single-node worker's loop; `create_app_for_model`: the folder's tokenizer;
uvicorn on a loopback port), and the prompts go over HTTP to /v1/completions (temperature 0, `ignore_eos`,
`logprobs: 0`), concurrently for the batched case. It costs about what an in-process engine would (a server
starts in ~1 s; the time is the model's). The API carries no token ids, so the test reads them from the
answer's per-token strings (`logprobs.tokens`): SmolLM2's 49,152 tokens have 49,152 distinct display strings,
so each names exactly one id (the test checks this for every string it reads). The reference is mlx-lm's model loaded by
`mlx_lm.load` from the same folder, run greedily over mlx-lm's own `make_prompt_cache` (the loop of
`mlx_lm.generate_step` with the logprobs taken in float32 from the model's logits, as the engine reports
them: `generate_step` takes them in the logits' dtype, which for bfloat16 rounds them by up to ~0.1 nats).

Tolerances on the logprobs. The quantized folders compute in float32: the same packed weights go through
the same `quantized_matmul`, and only the batch's shape and the paged KV differ, which move a float32 logprob
by rounding alone (the README's float-KV bound is 3.4e-5 nats); 1e-3 nats as in tests/test_model_families.py
(measured here: at most 1.2e-5, and 0 for a prompt alone). The bfloat16 folder computes in bfloat16, whose 8-bit
mantissa holds a logit of SmolLM2's size (the chosen tokens' logits here are 13 to 42) to steps of 0.125
(16-32) or 0.25 (32-64): a different rounding anywhere upstream moves a logit, so a logprob, by about one such
step, and the tolerance is one step, 0.25 nats (measured here: 0, alone and batched: the engine's logits equal
mlx-lm's bit for bit).

Time: MLX's CPU backend runs quantized matmuls one token row at a time (a 4-bit SmolLM2 forward costs ~0.2 s
per row, a batch of 3 rows three times that; the float32 model ~0.08 s per decode step), so the prompts are
short (5-6 tokens) and the answers 6 tokens. The module takes ~55 s on the 2-core dev machine: per format
~5 s of setup (conversion ~1.5 s, the reference, the server's start) and ~4-5 s per test.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from contextlib import contextmanager

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.live_server import live_model_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
NEW_TOKENS = 6
# format: (what mlx_lm.convert is given, the server's dtype for the folder (the dtype its weights hold),
# the logprob tolerance in nats, see the module docstring)
FORMATS = {
    "4-bit": (dict(quantize=True, q_bits=4, q_group_size=64), "float32", 1e-3),
    "8-bit": (dict(quantize=True, q_bits=8, q_group_size=64), "float32", 1e-3),
    "bfloat16": (dict(dtype="bfloat16"), "bfloat16", 0.25),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def folder(request, tmp_path_factory):
    """(format name, folder) of the default model converted by mlx-lm's own converter (~1.5 s)."""
    from mlx_lm import convert

    from cluster.gguf_import import ensure_default_model

    out = tmp_path_factory.mktemp("converted") / f"SmolLM2-{request.param}"
    convert(hf_path=str(ensure_default_model(progress=False)), mlx_path=str(out), **FORMATS[request.param][0])
    yield request.param, out
    shutil.rmtree(out, ignore_errors=True)  # 80-270 MB each; pytest keeps its last runs' tmp folders


def mlx_lm_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy generation over its own prompt cache: (tokens, float32 logprobs of those tokens)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens, logprobs, x = [], [], mx.array([prompt])
    for _ in range(max_tokens):
        logits = model(x, cache=cache)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        token = int(mx.argmax(lp).item())
        tokens.append(token)
        logprobs.append(lp[token].item())
        x = mx.array([[token]])
    return tokens, logprobs


@pytest.fixture(scope="module")
def reference(folder):
    """Per prompt: (prompt ids, mlx-lm's greedy tokens, their logprobs, their text), from `mlx_lm.load` of the
    folder."""
    from mlx_lm import load

    model, tokenizer = load(str(folder[1]))
    out = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        tokens, logprobs = mlx_lm_greedy(model, ids, NEW_TOKENS)
        out.append((ids, tokens, logprobs, tokenizer.decode(tokens)))
    return out


@pytest.fixture(scope="module")
def server(folder):
    """(base URL, engine client, token ids by display string) of `mlx-pd serve --model FOLDER` at the folder's
    dtype. Display strings are the API's `logprobs.tokens` (the router's `token_text`); only those of a single
    id are kept, so a string outside the map names no id for certain. The servers skip the load check, as a tested
    family may: on MLX's CPU backend quantized matmuls make it cost 50 s for the 8-bit SmolLM2 (tests/test_load_check.py
    runs it on quantized weights of a small model)."""
    from router.tokenizer import RouterTokenizer

    name, path = folder
    with live_model_server(path, dtype=FORMATS[name][1], kv_cache_gb=0.25, skip_load_check=True) as (base, client):
        tok = RouterTokenizer.from_path(path)
        texts = [tok.token_text(i) for i in range(tok.vocab_size)]
        counts = Counter(texts)
        yield base, client, {t: i for i, t in enumerate(texts) if counts[t] == 1}


def complete(base: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_answer(answer: dict, ref, token_ids: dict[str, int], tol: float, what: str) -> None:
    """The answer's token ids (named by their display strings), logprobs and text are the reference's."""
    ids, tokens, logprobs, text = ref
    assert answer["usage"]["prompt_tokens"] == len(ids), what
    choice = answer["choices"][0]
    got = choice["logprobs"]["tokens"]
    assert all(s in token_ids for s in got), f"{what}: a token string that names no single id: {got}"
    assert [token_ids[s] for s in got] == tokens, f"{what}: {choice['text']!r} vs mlx-lm's {text!r}"
    assert choice["text"] == text, what
    got_lp = choice["logprobs"]["token_logprobs"]
    assert np.allclose(got_lp, logprobs, atol=tol, rtol=0), f"{what}: {got_lp} vs mlx-lm's {logprobs}"


@contextmanager
def decode_batch_sizes(client):
    """Record how many sequences each decode step of the server's engine computed (the runner's forward,
    wrapped on its instance while the block runs; called on the engine's own thread)."""
    runner, sizes = client.engine.runner, []
    forward = runner.forward

    def recording(items, *args):
        # one new token per row: a decode step (a row fed its token in flight has it on the device)
        if all(len(it.token_ids) + (it.inflight_request is not None) == 1 for it in items):
            sizes.append(len(items))
        return forward(items, *args)

    runner.forward = recording
    try:
        yield sizes
    finally:
        del runner.forward


def test_the_server_runs_the_folders_weights_as_stored(folder, server):
    """The served model keeps the folder's format: quantized layers at its bits and group size (not
    dequantized at load), bfloat16 weights as bfloat16."""
    import mlx.nn as nn

    name, _ = folder
    model = server[1].engine.runner.model
    proj = model.model.layers[0].mlp.down_proj
    if name == "bfloat16":
        assert isinstance(proj, nn.Linear) and proj.weight.dtype == mx.bfloat16
    else:
        bits = FORMATS[name][0]["q_bits"]
        assert isinstance(proj, nn.QuantizedLinear) and (proj.bits, proj.group_size) == (bits, 64)
        assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # also the tied output head


def test_each_prompt_alone_gets_mlx_lms_greedy_tokens_and_logprobs(folder, reference, server):
    """Each prompt sent alone: every greedy token id, the text and the logprobs equal mlx-lm's generation on
    the same folder."""
    name, path = folder
    base, _, token_ids = server
    for i, (prompt, ref) in enumerate(zip(PROMPTS, reference)):
        check_answer(complete(base, path.name, prompt), ref, token_ids, FORMATS[name][2], f"{name}: prompt {i} alone")


def test_prompts_sent_at_once_share_decode_steps_and_get_mlx_lms_greedy_tokens_and_logprobs(folder, reference, server):
    """All prompts sent at the same time (concurrent HTTP requests, batched by the engine: some decode step
    computes all of them together): every answer's greedy token ids, text and logprobs still equal mlx-lm's
    generation of that prompt alone."""
    name, path = folder
    base, client, token_ids = server
    answers = [None] * len(PROMPTS)

    def ask(i: int) -> None:
        answers[i] = complete(base, path.name, PROMPTS[i])

    with decode_batch_sizes(client) as sizes:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert max(sizes) == len(PROMPTS), f"the requests never decoded together: decode batch sizes {sizes}"
    for i, (answer, ref) in enumerate(zip(answers, reference)):
        assert answer is not None, f"{name}: prompt {i} got no answer"
        check_answer(answer, ref, token_ids, FORMATS[name][2], f"{name}: prompt {i} sent with the others")
