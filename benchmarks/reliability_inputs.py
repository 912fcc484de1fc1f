"""What `mlx-pd bench reliability` sends (no network, no model): hostile frames and the soak's request mix.

    control_garbage(rng, per_kind)     [(kind, frames)] for a worker's control socket (cluster/protocol.py)
    kv_garbage(rng, per_kind, fmt)     [(kind, frames)] for a decode worker's KV socket (kv_transfer/wire.py)
    soak_workload(n, seed, speculative=True)   the soak's requests: [SoakItem]
    reference_key(item)                what makes two requests' greedy outputs comparable (the cache key)

Every frame list is one ZeroMQ multipart message as a peer would send it through a DEALER socket. Kinds:
random bytes, truncated and bit-flipped valid messages, oversized headers, wrong versions, unknown types,
valid messages naming request ids or epochs nobody knows, bad field types, extra or missing frames. The
`generate_*` control kinds are valid requests an authenticated peer may send; what the worker must do with
each is in CONTROL_EXPECT / KV_EXPECT (docs/RELIABILITY.md explains them).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Optional

import msgpack

from benchmarks.loadgen import load_prompts
from benchmarks.workloads import system_prompt

MAX_HEADER_BYTES = 16 * 2**20  # cluster.protocol.MAX_HEADER_BYTES (imported lazily there: it pulls in pydantic)


def _pack(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def _request(rid: str, tokens: list[int], **sampling) -> dict:
    return {"request_id": rid, "prompt_token_ids": tokens, "sampling": {"max_tokens": 2, **sampling}}


def _mutate(rng: random.Random, frame: bytes, rate: float = 0.08) -> bytes:
    out = bytes(b ^ (1 << rng.randint(0, 7)) if rng.random() < rate else b for b in frame)
    return out if out != frame else bytes([frame[0] ^ 0x01]) + frame[1:]


def _common(rng: random.Random, per_kind: int, valid: bytes) -> list[tuple[str, list[bytes]]]:
    """Kinds both sockets get: random, truncated, mutated, oversized, empty, too many frames."""
    out: list[tuple[str, list[bytes]]] = []
    out += [("random", [rng.randbytes(rng.randint(1, 256))]) for _ in range(per_kind)]
    cuts = sorted(rng.sample(range(len(valid)), min(per_kind, len(valid))))
    out += [("truncated", [valid[:k]]) for k in cuts]
    out += [("mutated", [_mutate(rng, valid)]) for _ in range(per_kind)]
    out += [("oversized", [b"\x81" + b"\xa1x" * ((MAX_HEADER_BYTES + 2) // 2)]),  # a >16 MiB "header"
            ("oversized", [_pack({"version": 1, "type": "ping", "seq": 1, "pad": "x" * 2**20})])]
    out += [("empty", [b""]), ("empty", [b"\x80"]), ("empty", [b"\xc0"])]  # empty frame, {} and nil
    return out


def control_garbage(rng: random.Random, per_kind: int = 20, role: str = "decode",
                    closed_endpoint: str = "tcp://127.0.0.1:9") -> list[tuple[str, list[bytes]]]:
    """Hostile messages for a worker's control socket (`role`: the worker's). None of them may change the
    worker's state for good: the `generate_*` kinds are requests an authenticated peer may send and then
    abandon (its socket is closed at once): `generate_invalid` can never run (400 `rejected`);
    `generate_abandoned` is a valid request that can never finish normally (decode worker: `prefilled`, but no
    prefill worker will ever send its KV; prefill worker: its decode worker's KV socket, `closed_endpoint`,
    does not exist). Whatever the worker holds for them must be gone by the end (the baseline phase)."""
    valid = _pack({"version": 1, "type": "generate", "request": _request("fuzz-valid", [1, 2, 3]),
                   "decode_endpoint": None, "prefilled": False})
    out = _common(rng, per_kind, valid)
    out += [("wrong_version", [_pack({"version": v, "type": "ping", "seq": 1})]) for v in (0, 2, 255, -1, "1", None)]
    out += [("unknown_type", [_pack({"version": 1, "type": t})]) for t in ("launch_missiles", "", "PING", "pong")]
    out += [("unknown_request_id", [_pack({"version": 1, "type": "abort", "request_id": f"never-seen-{i}"})])
            for i in range(per_kind)]
    out += [("bad_fields", [_pack(d)]) for d in (
        {"version": 1, "type": "ping", "seq": -1},
        {"version": 1, "type": "ping", "seq": "1"},
        {"version": 1, "type": "ping", "seq": 1, "extra": True},
        {"version": 1, "type": "abort", "request_id": ""},
        {"version": 1, "type": "abort", "request_id": "x" * 300},
        {"version": 1, "type": "generate", "request": [1, 2, 3]},
        {"version": 1, "type": "generate", "request": {}, "decode_endpoint": "x" * 600},
        {1: 2, 3: 4}, [1, 2, 3], "version")]
    out += [("extra_frames", [_pack({"version": 1, "type": "ping", "seq": 1}), b"extra"]),
            ("extra_frames", [b"", b"", b""])]
    # requests that can never run, invalid in the message (its validation names the request id) or for the
    # engine (a token id outside the vocabulary): each must get a 400 `rejected`, and leave nothing behind
    out += [("generate_invalid", [_pack({"version": 1, "type": "generate", "request": r, "prefilled": False})])
            for r in (_request(f"fuzz-empty-{rng.randrange(10**9)}", []),
                      _request(f"fuzz-vocab-{rng.randrange(10**9)}", [10**9]),
                      _request(f"fuzz-neg-{rng.randrange(10**9)}", [1], max_tokens=-5),
                      _request(f"fuzz-temp-{rng.randrange(10**9)}", [1], temperature=-1.0),
                      {"request_id": f"fuzz-str-{rng.randrange(10**9)}", "prompt_token_ids": "abc", "sampling": {}},
                      {"request_id": f"fuzz-noprompt-{rng.randrange(10**9)}", "sampling": {}})]
    abandoned = _request(f"fuzz-abandoned-{rng.randrange(10**9)}", list(range(1, 40)))
    if role == "decode":
        msg = {"version": 1, "type": "generate", "request": abandoned, "prefilled": True}
    else:
        msg = {"version": 1, "type": "generate", "request": abandoned, "decode_endpoint": closed_endpoint}
    out.append(("generate_abandoned", [_pack(msg)]))
    return out


CONTROL_EXPECT = ("no answer and no effect, except generate_invalid: a 400 `rejected` each; the worker "
                  "answers pings throughout")


def kv_garbage(rng: random.Random, per_kind: int = 20, fmt: Optional[dict] = None) -> list[tuple[str, list[bytes]]]:
    """Hostile messages for a decode worker's KV socket. `fmt` (a KVFormat as a dict) makes the
    `offer_wrong_format` kind (answered `refused`); nothing else may be answered or change the pool."""
    valid_blocks = _pack({"version": 1, "type": "blocks", "request_id": "fuzz-kv", "epoch": 1, "block_start": 0,
                          "num_blocks": 1, "block_hashes": [1], "layer_start": 0, "num_layers": 1,
                          "kv_bits": None, "kv_group_size": 64,
                          "arrays": [{"name": "k", "dtype": "float32", "shape": [1, 4, 1, 2]}]})
    out = _common(rng, per_kind, valid_blocks)
    out += [("wrong_version", [_pack({"version": v, "type": "abort", "request_id": "r", "reason": "x"})])
            for v in (0, 2, 255, "1", None)]
    out += [("unknown_type", [_pack({"version": 1, "type": t, "request_id": "r"})])
            for t in ("steal_blocks", "", "OFFER", "reserved")]
    payload = bytes(4 * 8)
    for i in range(per_kind):  # well-formed messages aimed at transfers nobody started
        rid, epoch = f"never-offered-{i}", rng.randrange(2**40)
        kind = ("blocks", "done", "abort")[i % 3]
        if kind == "blocks":
            msg = [_pack({"version": 1, "type": "blocks", "request_id": rid, "epoch": epoch, "block_start": 0,
                          "num_blocks": 1, "block_hashes": [rng.randrange(2**64)], "layer_start": 0,
                          "num_layers": 1, "kv_bits": None, "kv_group_size": 64,
                          "arrays": [{"name": "k", "dtype": "float32", "shape": [1, 4, 1, 2]}]}), payload]
        elif kind == "done":
            msg = [_pack({"version": 1, "type": "done", "request_id": rid, "epoch": epoch, "first_token": 1,
                          "first_logprob": None})]
        else:
            msg = [_pack({"version": 1, "type": "abort", "request_id": rid, "epoch": epoch, "reason": "fuzz"})]
        out.append(("unknown_request_id", msg))
    out += [("bad_fields", [_pack(d)]) for d in (
        {"version": 1, "type": "blocks", "request_id": "r", "epoch": -1},
        {"version": 1, "type": "done", "request_id": "r", "epoch": 1, "first_token": -1},
        {"version": 1, "type": "offer", "request_id": "r", "format": {}, "token_ids": [1]},
        {"version": 1, "type": "offer", "request_id": "r", "format": "float32", "token_ids": "x"},
        {"version": 1, "type": "ack", "request_id": "", "epoch": 1},
        {1: 2}, [1, 2], "blocks")]
    out += [("extra_frames", [_pack({"version": 1, "type": "abort", "request_id": "r", "reason": "x"}), b"x" * 64]),
            ("extra_frames", [valid_blocks]),  # a blocks header without its array frame
            ("extra_frames", [valid_blocks, payload, payload])]
    if fmt is not None:
        for i, (key, value) in enumerate((("revision", "0" * 16), ("num_layers", 7), ("dtype", "float16"),
                                          ("block_size", 16), ("model_id", "someone-else"))):
            bad = dict(fmt, **{key: value})
            out.append(("offer_wrong_format", [_pack({"version": 1, "type": "offer", "request_id": f"fuzz-fmt-{i}",
                                                      "format": bad, "token_ids": list(range(1, 65)),
                                                      "cache_salt": None})]))
    return out


KV_EXPECT = ("no answer and no effect, except offer_wrong_format: `refused` naming the field; the worker's "
             "free KV blocks are back at their total afterwards")


# -- the soak's requests -------------------------------------------------------------------------------------

SOAK_MIX = (("chat", 0.34), ("tenant", 0.26), ("long", 0.08), ("disconnect", 0.10), ("sampled", 0.22))
SPECULATIVE = {"method": "prompt_lookup", "num_draft_tokens": 4}
_WORDS = ("the river carries silt from the mountains to the delta where farmers plant rice in spring and harvest "
          "it before the monsoon while merchants in the old port count barrels of oil and bolts of cloth under "
          "a sky that turns copper at dusk").split()


@dataclass
class SoakItem:
    """One soak request: `body` for POST `path` (the model name is added when sending). `compare`: greedy and
    run to its end, so its output must equal the single-node reference's. `disconnect_after`: close the
    stream after this many events (a deliberate client disconnect)."""

    index: int
    kind: str
    path: str
    body: dict
    compare: bool
    speculative: bool = False
    disconnect_after: Optional[int] = None
    tags: list = field(default_factory=list)


def long_document(index: int, words: int) -> str:
    """A deterministic document of `words` words (different for each index from its first line on)."""
    rng = random.Random(f"long:{index}")
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Report {index}: {body}."


def soak_workload(n: int, seed: int = 0, *, speculative: bool = True, num_questions: int = 40,
                  num_tenants: int = 6, users_per_tenant: int = 8, num_long: int = 6,
                  long_words: tuple[int, int] = (800, 1400), max_tokens: int = 16) -> list[SoakItem]:
    """`n` requests of the kinds in SOAK_MIX, shuffled with `seed`. Greedy prompts come from small pools
    (questions, tenants' two-turn chats with shared system prompts, long documents) so references repeat;
    with `speculative`, every other greedy request asks for prompt-lookup speculative decoding."""
    rng = random.Random(f"soak:{seed}")
    questions = load_prompts()[:num_questions]
    systems = [system_prompt(t, 320, seed=seed, tag=f"tenant-{t}") for t in range(num_tenants)]
    lengths = [rng.randint(*long_words) for _ in range(num_long)]
    counts = {k: int(n * f) for k, f in SOAK_MIX}
    counts["chat"] += n - sum(counts.values())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    items, greedy = [], 0
    for i, kind in enumerate(kinds):
        stream = rng.random() < 0.75
        path, body, compare, tags, disconnect = "/v1/chat/completions", {}, True, [], None
        if kind == "chat":
            body = {"messages": [{"role": "user", "content": rng.choice(questions)}]}
        elif kind == "tenant":
            t, u = rng.randrange(num_tenants), rng.randrange(users_per_tenant)
            q1, q2 = questions[(t * 7 + u) % len(questions)], questions[(t * 7 + u + 13) % len(questions)]
            messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": q1}]
            if rng.random() < 0.5:
                messages += [{"role": "assistant", "content": f"Here is a short answer about item {u}."},
                             {"role": "user", "content": q2}]
                tags.append("turn-2")
            body = {"messages": messages}
            if t % 2:
                body["cache_salt"] = f"tenant-{t}"
        elif kind == "long":
            d = rng.randrange(num_long)
            path = "/v1/completions"
            body = {"prompt": long_document(d, lengths[d]) + "\nQuestion: what does the report say about the river?"
                                                               "\nAnswer:", "max_tokens": 16}
        elif kind == "disconnect":
            stream, compare = True, False
            disconnect = rng.randint(1, 4)
            if rng.random() < 0.3:
                d = rng.randrange(num_long)
                path, body = "/v1/completions", {"prompt": long_document(d, lengths[d]) + "\nSummary:"}
                tags.append("long")
            else:
                body = {"messages": [{"role": "user", "content": rng.choice(questions)}]}
            body["max_tokens"] = 64
        else:  # sampled
            compare = False
            body = {"messages": [{"role": "user", "content": rng.choice(questions)}],
                    "temperature": 0.8, "top_p": 0.95}
        body.setdefault("max_tokens", max_tokens)
        if compare or kind == "disconnect":
            body["temperature"] = 0
        spec = False
        if compare:
            spec = speculative and greedy % 2 == 1
            greedy += 1
            if spec:
                body["speculative"] = dict(SPECULATIVE)
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        items.append(SoakItem(i, kind, path, body, compare, spec, disconnect, tags))
    return items


def reference_key(path: str, body: dict) -> str:
    """Requests with the same key have the same greedy output: the body without transport and speculative
    fields (speculative decoding is lossless under greedy sampling)."""
    core = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "speculative", "model")}
    return path + " " + json.dumps(core, sort_keys=True)
