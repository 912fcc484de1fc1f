"""The snapshots phase of `mlx-pd bench hybrid-turns` (benchmarks/hybrid_bench.py): an in-process engine (the
code `mlx-pd serve` runs) replays the server's conversation and reads its state snapshots after each turn, as a
cross-check of the server's /metrics and answers, and to show where each turn's prompt leaves the previous
answer's token ids."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from benchmarks.compare import OURS, eos_token_ids
from benchmarks.hybrid_report import MiB
from benchmarks.workloads import ChatTokens, Conversation, common_prefix_len


class InProcessEngine:
    """An `EngineCore` over the model folder (what `mlx-pd serve` runs), driven one request at a time."""

    def __init__(self, model_dir: str, **config):
        from cluster.config import EngineConfig
        from cluster.engine import EngineCore
        from cluster.model import load_model, served_model

        self.config = EngineConfig(dtype="float32", **config)
        path, spec = served_model(model_dir, None, "float32")
        model, tokenizer = load_model(path, dtype="float32")
        self.engine = EngineCore(model, tokenizer, spec, self.config)
        # the state snapshots of its recurrent-state KV cache group (cluster/kv/state_group.py)
        self.snapshots = next((g.snapshots for g in self.engine.kv.groups if hasattr(g, "snapshots")), None)
        if self.snapshots is None:
            raise ValueError(f"{model_dir} has no recurrent layers: it keeps no state snapshots")
        self.n = 0

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, suppress: Sequence[int]) -> dict:
        """Greedy, EOS blocked as the HTTP requests do; {token_ids, text, cached_tokens, seconds}."""
        from cluster.request import GenerateRequest, SamplingParams

        self.n += 1
        rid = f"replay-{self.n}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  logit_bias=tuple((t, -100.0) for t in suppress))
        t0 = time.perf_counter()
        self.engine.add_request(GenerateRequest(rid, tuple(prompt_ids), sampling))
        ids, text, cached, final = [], [], 0, None
        while final is None:
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                ids += out.token_ids
                text.append(out.text)
                cached = max(cached, out.num_cached_tokens)
                if out.error:
                    raise RuntimeError(f"in-process request failed: {out.error}")
                if out.finish_reason is not None:
                    final = out
        return {"token_ids": ids, "text": "".join(text), "cached_tokens": cached,
                "seconds": time.perf_counter() - t0}

    def stats(self) -> dict:
        s = self.snapshots
        return {"snapshots": len(s), "bytes": s.nbytes, "budget_bytes": s.budget_bytes, "saved": s.num_saved,
                "evicted": s.num_evicted, "restored": s.num_restored,
                "kv_blocks_cached": self.engine.pool.num_cached_blocks,
                "kv_blocks_total": self.engine.pool.num_usable_blocks}


def replay_turns(engine: InProcessEngine, tokens: ChatTokens, turn_messages: Sequence[list[dict]],
                 http: Sequence[dict], max_tokens: int, suppress: Sequence[int], log, label: str) -> list[dict]:
    """Replay one conversation's recorded messages; per turn the engine's snapshot stats, its cached tokens and
    answer beside the server's (`http`: that server's records, or empty), and how many tokens of the previous
    turn's prompt + answer the next prompt shares as re-tokenized."""
    rows, prev = [], None
    for t, msgs in enumerate(turn_messages):
        ids = tokens.render(msgs)
        got = engine.generate(ids, max_tokens, suppress)
        row = {"turn": t + 1, "prompt_tokens": len(ids), "cached_tokens": got["cached_tokens"],
               "seconds": got["seconds"], **engine.stats()}
        if prev is not None:  # the previous prompt + its answer ids, against this prompt
            row["previous_prompt_tokens"] = len(prev[0])
            row["shared_with_previous"] = shared = common_prefix_len(prev[0] + prev[1], ids)
            # the most a block-granular cache could restore: whole blocks of what this prompt shares (and never
            # the prompt's last token)
            bs = engine.engine.block_size
            row["block_ideal"] = min(shared, len(ids) - 1) // bs * bs
        if t < len(http):
            row["http_prompt_tokens"], row["http_cached_tokens"] = http[t]["prompt_tokens"], http[t]["cached_tokens"]
            row["same_answer_as_http"] = got["text"] == http[t]["text"]
        prev = (ids, got["token_ids"])
        rows.append(row)
        log(f"{label} turn {t + 1}: prompt {len(ids)}, cached {got['cached_tokens']}, {row['snapshots']} snapshots, "
            f"{row['bytes'] / MiB:.1f} of {row['budget_bytes'] / MiB:.0f} MiB, saved {row['saved']}, "
            f"evicted {row['evicted']}, restored {row['restored']} ({got['seconds']:.1f} s)")
    return rows


def run_snapshots(args, model_dir: str, tokens: ChatTokens, turns: Optional[dict], rss_convs: list[Conversation],
                  log) -> dict:
    suppress = eos_token_ids(model_dir)
    out = {}
    if turns and OURS in turns["messages"]:
        engine = InProcessEngine(model_dir)
        out["turns"] = {"config": {"state_cache_gb": engine.snapshots.budget_bytes / 2**30,
                                   "kv_cache_gb": engine.config.kv_cache_gb, "block_size": engine.engine.block_size},
                        "rows": replay_turns(engine, tokens, turns["messages"][OURS], turns["records"][OURS],
                                             args.max_tokens, suppress, log, "replay")}
        del engine
    if args.replay_conversations > 0:
        engine = InProcessEngine(model_dir, kv_cache_gb=args.rss_kv_cache_gb, state_cache_gb=args.rss_state_cache_gb)
        rows = []
        for conv in rss_convs[:args.replay_conversations]:
            msgs: list[list[dict]] = []  # filled turn by turn with the engine's own answers
            replies: list[str] = []
            for t in range(len(conv.questions)):
                msgs.append(conv.messages(t, replies))
                got = engine.generate(tokens.render(msgs[-1]), args.rss_max_tokens, suppress)
                replies.append(got["text"])
            rows.append({"conversation": conv.user + 1, **engine.stats()})
            r = rows[-1]
            log(f"replay of rss conversation {conv.user + 1}: {r['snapshots']} snapshots, "
                f"{r['bytes'] / MiB:.1f} of {r['budget_bytes'] / MiB:.0f} MiB, evicted {r['evicted']}")
        out["rss"] = {"config": {"state_cache_gb": args.rss_state_cache_gb, "kv_cache_gb": args.rss_kv_cache_gb},
                      "rows": rows}
    return out
