"""Reasoning across the prefill/decode handoff: a 1P1D cluster in this process (workers over tcp loopback, the router's
client without HTTP) serving the qwen3 thinking fixture. The prefill worker samples the first token under the
reasoning rule (the forced end marker at budget 0, the grammar's mask or the start marker for the first token) and
streams its text and count; the decode worker rebuilds the reasoning state from `starts_inside` and that first
token and goes on. Every request's tokens, texts and counts are the single engine's."""

from __future__ import annotations

import asyncio

from cluster.topology import parse_topology
from tests.cluster_helpers import topology_text
from tests.engine_helpers import run
from tests.reasoning_helpers import engine, grammar, joined, prompt, qwen3, reasoning, request


def cluster_requests():
    _, start, _ = qwen3()
    return [request("b0", 8, ignore_eos=True, reasoning=reasoning(budget=0)),  # the prefill worker forces </think>
            request("b1", 10, prompt("Name a fruit."), ignore_eos=True, reasoning=reasoning(budget=1)),
            request("b4", 12, prompt("Say hello."), ignore_eos=True, reasoning=reasoning(budget=4)),
            request("json", 40, prompt("Is it sunny?"), grammar=grammar(), reasoning=reasoning(budget=3)),
            request("opens", 9, prompt("Count to three.", inside=False), grammar=grammar(),
                    logit_bias=((start, 100.0),), reasoning=reasoning(budget=2, inside=False)),
            request("plain", 8, prompt("Hi.", inside=False), ignore_eos=True)]


def run_1p1d(requests) -> tuple[dict, int]:
    """Each request's outputs through the cluster, and the masks the prefill worker computed."""
    from cluster.launch.workers import make_worker
    from router.cluster_client import ClusterEngineClient

    loaded = qwen3()[0]
    topology = parse_topology(topology_text(engine="block_size = 8",
                                            routing="local_prefill_max_tokens = 0"), name="reasoning-1p1d")
    workers = {w.name: make_worker(topology, w.name, loaded) for w in topology.workers}

    async def generate():
        client = ClusterEngineClient(topology, loaded[2].model_id, loaded[2].max_model_len, revision=loaded[2].revision)

        async def one(r):
            return [out async for out in client.generate(r)]
        try:
            assert await client.wait_ready(60), "a worker never answered"
            return dict(zip([r.request_id for r in requests], await asyncio.gather(*map(one, requests))))
        finally:
            await client.close()

    try:
        for w in workers.values():
            w.start()
        return asyncio.run(generate()), workers["prefill-0"].engine.grammars.num_mask_rows
    finally:
        for w in workers.values():
            w.stop()


def test_one_prefill_one_decode_gives_the_single_engines_tokens_texts_and_counts():
    _, _, end = qwen3()
    single = run(engine(), cluster_requests())
    results, prefill_masks = run_1p1d(cluster_requests())
    for rid, outputs in results.items():
        want = single[rid]
        assert [t for o in outputs for t in o.token_ids] == want.token_ids, rid
        assert "".join(o.text for o in outputs) == want.text, rid
        assert "".join(o.reasoning_text for o in outputs) == joined(want, "reasoning_text"), rid
        assert [o.num_reasoning_tokens for o in outputs if o.token_ids] == \
            [o.num_reasoning_tokens for o in want.outputs if o.token_ids], rid
        assert outputs[-1].finish_reason is want.final.finish_reason, rid
    assert single["b0"].token_ids[0] == end  # the first token, forced on the prefill worker
    assert single["b1"].token_ids[1] == end  # forced on the decode worker after the prefill worker's one
    # the prefill worker's first tokens under a rule: b0's forced marker, and the grammar plus the start marker
    # of "opens"; json's first token is reasoning, free
    assert prefill_masks == 2
