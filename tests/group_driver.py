"""Runs one side of the worker-group tests in processes of its own (a process joins one MLX collective only):

- `reference PARALLEL FOLDER PROMPTS OUT`, on every rank of a ring group (MLX_HOSTFILE, MLX_RANK): mlx-lm's own
  tensor- or pipeline-parallel generation (`sharded_load`, `generate_step`) of each prompt alone; rank 0 writes
  {"tokens", "logprobs"} per prompt.
- `engine PARALLEL[:SIZE] FOLDER PROMPTS REFERENCE OUT`: rank 0 of a local group of SIZE (default 2; the other
  ranks child processes), whose engine runs the prompts alone, together, again after their blocks are cached,
  and with drafts to verify; writes each run's tokens and logprobs, every rank's memory and what the leader
  sent. A group of more than 2 sizes its pool by bytes (`kv_cache_gb`), so ranks of unequal layers must agree
  on a block count; one of 2 has a fixed `num_blocks`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

NEW_TOKENS = 6


def reference(parallel: str, folder: str, prompts: list, out: str) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = sharded_load(folder, **{f"{parallel}_group": group})
    results = []
    for prompt in prompts:
        tokens, logprobs = [], []
        for token, lp in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS):
            token = int(token.item()) if isinstance(token, mx.array) else int(token)
            tokens.append(token)
            logprobs.append(lp[token].item())
        results.append({"tokens": tokens, "logprobs": logprobs})
    if group.rank() == 0:
        Path(out).write_text(json.dumps(results))


def engine(parallel: str, folder: str, prompts: list, reference_path: str, out: str) -> None:
    from cluster.config import EngineConfig
    from cluster.launch.local_group import local_plan, start_local_group
    from decode_node.speculative import DecodeSpeculator
    from tests.engine_helpers import run
    from tests.family_helpers import ReferenceDrafter, request

    refs = json.loads(Path(reference_path).read_text())
    parallel, _, size = parallel.partition(":")
    size = int(size or 2)
    pool = {"num_blocks": 96} if size == 2 else {"kv_cache_gb": 0.002}
    config = EngineConfig(dtype="float32", block_size=8, enable_prefix_caching=True, **pool)
    started, followers = start_local_group(local_plan(size, folder, "group-test", config, parallel=parallel))
    eng = started.engine

    def tokens_and_logprobs(results: dict) -> dict:
        return {rid: {"tokens": r.token_ids, "logprobs": [lp.logprob for lp in r.logprobs],
                      "cached": r.final.num_cached_tokens} for rid, r in results.items()}

    n = len(prompts) // 2  # the first half runs alone, cold; the second half together, cold
    runs = {"solo": {}, "batched": {}, "cached": {}, "speculative": {}}
    for i in range(n):
        runs["solo"].update(tokens_and_logprobs(run(eng, [request(f"solo{i}", prompts[i])])))
    runs["batched"] = tokens_and_logprobs(run(eng, [request(f"batch{i}", prompts[i]) for i in range(n, 2 * n)]))
    runs["cached"] = tokens_and_logprobs(run(eng, [request(f"cached{i}", p) for i, p in enumerate(prompts)]))
    recurrent = bool(eng.runner.verified.num_state_layers)  # speculation cannot roll a recurrent state back
    if not recurrent:
        eng.speculator = DecodeSpeculator({"prompt_lookup": ReferenceDrafter(
            {tuple(p): r["tokens"] for p, r in zip(prompts, refs)})}, eng.config)
        runs["speculative"] = tokens_and_logprobs(run(eng, [
            request(f"spec{i}", p, speculative_method="prompt_lookup", num_draft_tokens=3)
            for i, p in enumerate(prompts)]))
    deadline = time.monotonic() + 10
    while not all(started.heartbeat.peer_info.get(r) for r in range(1, size)) and time.monotonic() < deadline:
        time.sleep(0.1)
    memory = {str(r): started.heartbeat.peer_info.get(r) for r in range(1, size)}
    report = {"runs": runs, "memory": {"0": started.memory.report(), **memory},
              "forwards": started.leader.num_forwards, "bytes_sent": started.leader.bytes_sent,
              "drafts": None if recurrent else {"proposed": eng.speculator.num_draft_tokens,
                                                "accepted": eng.speculator.num_accepted_tokens},
              "kv_groups": [dataclasses.asdict(g) for g in eng.kv.group_stats()],
              "num_blocks": eng.pool.num_blocks}
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    mode, kind, folder, prompts_path, *rest = sys.argv[1:]
    prompt_list = json.loads(Path(prompts_path).read_text())
    if mode == "reference":
        reference(kind, folder, prompt_list, rest[0])
    else:
        engine(kind, folder, prompt_list, rest[0], rest[1])
