"""Speculative decoding without the model: the rejection-sampling rule keeps the target's distribution
(statistical test on a small vocabulary), draft lengths, prompt lookup, validation, wire and schema."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from cluster.config import EngineConfig
from cluster.protocol import from_wire, to_wire
from cluster.request import GenerateRequest, SamplingParams
from cluster.sampling import probabilities
from decode_node.drafters import NgramIndex
from decode_node.speculative import (PROBE_EVERY, SpeculationState, accept_greedy, accept_sampled, best_draft_length,
                                     expected_tokens)

V = 8  # vocabulary of the statistical test


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - 0.001 (z = the normal's 0.999 quantile), Wilson-Hilferty approximation
    (relative error < 1% for df >= 10)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` (cells expecting < 5 merged into one); (value, df)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def markov(seed: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """A target chain P and a different draft chain Q over V tokens (row = previous token). P goes through
    the engine's own sampling transform (temperature, top-k), so the test covers what verification uses."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, top_k=6)
    target_logits = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    P = np.stack([np.array(probabilities(mx.array(row), params, (), ())) for row in target_logits])
    Q = rng.dirichlet(np.full(V, 0.7), size=V)
    return P.astype(np.float64), Q


def speculative_pairs(P: np.ndarray, Q, n: int, k: int, seed: int) -> np.ndarray:
    """Counts [V, V] of the first two tokens generated from state 0 by speculative steps with k drafts:
    drafts from Q (a distribution per previous token, or None = a deterministic drafter proposing
    (prev + 1) % V, as prompt lookup's point masses), verified with `accept_sampled`."""
    rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    p_rows = mx.array(P.astype(np.float32))
    q_rows = None if Q is None else mx.array(Q.astype(np.float32))
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        out, prev = [], 0
        while len(out) < 2:
            draft, last = [], prev
            for _ in range(k):
                last = int(rng.choice(V, p=Q[last])) if Q is not None else (last + 1) % V
                draft.append(last)
            context = [prev] + draft  # row i of p / q: the next-token distributions after context[i]
            idx = mx.array(context, dtype=mx.int32)
            accepted, token, key = accept_sampled(p_rows[idx], None if q_rows is None else q_rows[idx[:k]],
                                                  draft, key)
            out += draft[:accepted] + [token]
            prev = out[-1]
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """The first two generated tokens follow the target chain: P[0, a] * P[a, b], over 64 cells.

    Bound: under the null hypothesis (the rule is exact) Pearson's statistic is chi-square with df = cells - 1
    (cells expecting < 5 samples merged), so the test passes unless it exceeds the 0.999 quantile: a correct
    rule fails with probability 0.001 for a random seed, and with the fixed seeds here it is deterministic.
    The same counts drawn without the rejection step (every draft accepted) exceed the bound by far, so the
    test has the power to see a wrong rule (asserted below)."""
    P, Q = markov(seed=7, temperature=0.7)
    n = 6000
    counts = speculative_pairs(P, Q if drafter == "model" else None, n=n, k=3, seed=11)
    truth = (P[0][:, None] * P).ravel()
    stat, df = chi2_statistic(counts.ravel(), truth)
    assert stat < chi2_critical(df), (stat, df)
    # power: a rule that accepts every draft generates from the draft chain instead
    rng = np.random.default_rng(3)
    wrong = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        a = rng.choice(V, p=Q[0]) if drafter == "model" else 1
        b = rng.choice(V, p=Q[a]) if drafter == "model" else 2
        wrong[a, b] += 1
    assert chi2_statistic(wrong.ravel(), truth)[0] > 10 * chi2_critical(df)


def test_accept_greedy_and_point_mass_rejection():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept_greedy([], [4]) == 0
    # a deterministic draft the target gives probability 0 is always rejected, and never re-emitted
    p = mx.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    key = mx.random.key(0)
    for _ in range(20):
        accepted, token, key = accept_sampled(p, None, [0], key)
        assert accepted == 0 and token in (1, 2)
    # a draft equal to the target's only token is always accepted; the bonus comes from the last row
    p = mx.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled(p, None, [0], key)[:2] == (1, 2)


def test_draft_length_follows_acceptance_and_cost():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_draft_length(0.9, 8, 0.0) == 8  # free drafts: always the maximum
    assert best_draft_length(0.05, 8, 0.1) == 0  # a hopeless drafter: off
    assert 0 < best_draft_length(0.7, 8, 0.1) < 8
    assert best_draft_length(0.9, 8, 1.0) == 0  # drafts as dear as the target: never worth it
    state = SpeculationState("prompt_lookup", 8)
    start = state.num_draft_tokens(0.1)
    for _ in range(10):
        state.update(start, 0)  # everything rejected: the length falls to 0 ...
    assert state.acceptance < 0.1
    ks = [state.num_draft_tokens(0.1) for _ in range(PROBE_EVERY)]
    assert ks.count(0) == PROBE_EVERY - 1 and ks[-1] == 1  # ... with a one-token probe now and then
    for _ in range(10):
        state.update(4, 4)
    assert state.num_draft_tokens(0.1) >= 4 and state.proposed_total == start * 10 + 40
    dear = SpeculationState("draft_model", 8)  # a draft slower than the target: off, and never probed
    assert [dear.num_draft_tokens(1.8) for _ in range(2 * PROBE_EVERY)] == [0] * 2 * PROBE_EVERY


def test_ngram_index_proposes_the_most_recent_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 5, 1]  # (1, 2, 3) last occurred at 4..6
    tokens += [4]
    assert index.propose(tokens, 2) == [5, 1]
    assert NgramIndex(2, 3).propose([7, 8, 9], 4) == []  # no repeated n-gram
    assert NgramIndex(1, 2).propose([7, 8, 7], 4) == [8, 7]  # the continuation may reach the end


def test_speculative_params_are_validated_and_travel():
    with pytest.raises(ValueError, match="speculative_method"):
        SamplingParams(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SamplingParams(num_draft_tokens=17)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="ngram")
    with pytest.raises(ValueError, match="draft_quantize_bits"):
        EngineConfig(draft_quantize_bits=3)
    assert EngineConfig(speculative_method="draft_model").uses_draft_model
    assert not EngineConfig(speculative_method="prompt_lookup").uses_draft_model
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=5, temperature=0, stop=("x",),
                                                             speculative_method="prompt_lookup", num_draft_tokens=6))
    assert from_wire(GenerateRequest, to_wire(request)) == request


def test_router_maps_the_speculative_field():
    from router.openai.request import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}],
            "speculative": {"method": "prompt_lookup", "num_draft_tokens": 4}}
    req = ChatCompletionRequest.model_validate(body)
    assert req.speculative.method == "prompt_lookup" and req.speculative.num_draft_tokens == 4
    assert ChatCompletionRequest.model_validate({"messages": body["messages"]}).speculative is None
    for bad in ({"method": "medusa"}, {"method": "prompt_lookup", "num_draft_tokens": 99},
                {"method": "prompt_lookup", "num_draft_tokns": 4}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({**body, "speculative": bad})


def test_topology_and_cli_accept_the_speculative_options():
    from cluster.launch.cli import _engine_config, build_parser
    from cluster.topology import parse_topology

    topo = parse_topology('[engine]\nspeculative_method = "prompt_lookup"\nnum_draft_tokens = 6\n'
                          'draft_quantize_bits = 8\n', name="t")
    assert (topo.engine.speculative_method, topo.engine.num_draft_tokens, topo.engine.draft_quantize_bits) == \
        ("prompt_lookup", 6, 8)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        parse_topology("[engine]\nnum_draft_tokens = 99\n", name="t")
    args = build_parser().parse_args(["serve", "--speculative-method", "draft_model", "--draft-model", "/m",
                                      "--draft-cost-per-token", "0.2"])
    config = _engine_config(args, topo)
    assert (config.speculative_method, config.num_draft_tokens, config.draft_model, config.draft_cost_per_token) == \
        ("draft_model", 6, "/m", 0.2)
