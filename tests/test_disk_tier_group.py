"""The SSD tier in a worker group (`mlx-pd serve --tensor-parallel 2` or `--pipeline-parallel 2`, processes of its own): each rank keeps its
own shard of every block in a folder of its own; sessions evicted from the ranks' pools come back from their
disks, and again after the whole group restarts, answering as one rank without a tier does; a block file one
follower lost makes every rank compute that hit, the answer stays right, and the block is written again on every
rank."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.live_server import live_model_server
from tests.test_worker_group_faults import serving

SESSIONS = 4
SESSION_TOKENS = 300
# each rank's pool: about 600 tokens (two sessions) of its share of the KV: the fast llama's half of the heads
# (1 KiB a token), or one of the two layers of the test family's qwen3_moe (256 bytes a token)
KV_GB = {"tensor": 0.0006, "pipeline": 0.00015}
FLAGS = ("--ssd-cache-gb", "0.05", "--block-size", "32", "--skip-load-check")


def _complete(base: str, model: str, prompt) -> tuple[tuple, int]:
    """(the answer: its text and each token's logprob, the prompt's cached tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["text"], choice["logprobs"]["token_logprobs"]), r.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def _same(got: tuple, cold: tuple) -> bool:
    """The same text, logprobs within 1e-3 (the project's tolerance for KV read back from a cache)."""
    return got[0] == cold[0] and np.allclose(got[1], cold[1], atol=1e-3, rtol=0)


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M))


def _rank_folders(tier_dir: Path) -> dict[int, Path]:
    """Each rank's tier folder, by the pid in its lock file: {pid: folder}."""
    return {int((d / "lock").read_text()): d for d in tier_dir.iterdir() if (d / "lock").exists()}


@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_a_group_keeps_each_ranks_shard_on_its_own_disk_and_restores_sessions_after_a_restart(parallel, tmp_path):
    """Two ranks splitting the heads (tensor: a llama) or the layers (pipeline: a qwen3_moe, whose mlx-lm class
    splits its layers)."""
    from benchmarks.reliability_long import fast_model_dir
    from tests.group_helpers import model_folder

    model_dir = fast_model_dir() if parallel == "tensor" else model_folder("qwen3_moe", tmp_path / "models")
    name = model_dir.name
    rng = np.random.RandomState(8)
    prompts = [rng.randint(100, 500, size=SESSION_TOKENS).tolist() for _ in range(SESSIONS)]
    tier_dir = tmp_path / "tier"
    flags = FLAGS + (f"--{parallel}-parallel", "2", "--kv-cache-gb", str(KV_GB[parallel]),
                     "--ssd-cache-dir", str(tier_dir))
    with live_model_server(model_dir, skip_load_check=True, block_size=32) as (base, _):  # one rank, no tier
        cold = [_complete(base, name, p) for p in prompts]
    with serving(model_dir, tmp_path / "first", *flags) as group:
        group.wait_healthy()
        for p in prompts:  # each session in turn: the pools hold two, the disks all four
            _complete(group.base, name, p)
        answer, cached = _complete(group.base, name, prompts[0])
        assert cached == SESSION_TOKENS // 32 * 32 and _same(answer, cold[0][0]), "not back from disk, or wrong"
        assert _metric(group.base, "mlx_pd_kv_ssd_blocks_loaded_total") >= SESSION_TOKENS // 32
        folders = _rank_folders(tier_dir)
        assert sorted(folders) == sorted([group.proc.pid, *group.followers]), folders
        leader, follower = folders[group.proc.pid], folders[group.followers[0]]
        names = {f.name for f in leader.glob("*.kv")}
        assert names and names == {f.name for f in follower.glob("*.kv")}  # the same blocks, each rank its shard
        assert all((leader / n).stat().st_size == (follower / n).stat().st_size for n in names)
        if parallel == "tensor":  # a second group on the same folders is refused, as a second server is
            with serving(model_dir, tmp_path / "second", *flags) as second:
                assert second.exit_code(60) == 2
                assert "is in use by another server" in second.output(), second.output()
    with serving(model_dir, tmp_path / "again", *flags) as group:  # RAM empty on both ranks, the disks as left
        group.wait_healthy()
        answer, cached = _complete(group.base, name, prompts[1])
        assert cached == SESSION_TOKENS // 32 * 32 and _same(answer, cold[1][0])
        folders = _rank_folders(tier_dir)
        follower = folders[group.followers[0]]
        victim = _first_block_file(follower, prompts[2])
        whole = victim.read_bytes()
        victim.write_bytes(whole[:100])  # torn on the follower only
        answer, cached = _complete(group.base, name, prompts[2])
        assert cached == 0 and _same(answer, cold[2][0])  # every rank computed it: the follower lost block 0
        deadline = time.monotonic() + 20  # and the leader had it written again, on every rank
        while not _whole_file(victim, len(whole)):
            assert time.monotonic() < deadline, "the follower's lost block was never written again"
            time.sleep(0.1)
        answer, cached = _complete(group.base, name, prompts[3])
        assert cached == SESSION_TOKENS // 32 * 32 and _same(answer, cold[3][0])


def _first_block_file(folder: Path, prompt) -> Path:
    """The block file in `folder` that caches the prompt's first 32 tokens."""
    import msgpack

    (found,) = [f for f in folder.glob("*.kv") if _tokens(f, msgpack) == list(prompt[:32])]
    return found


def _whole_file(path: Path, size: int) -> bool:
    """Whether `path` is a whole block file of `size` bytes (its checksum, hash and tokens right)."""
    import msgpack

    from cluster.kv.block_file import BlockFileError, decode

    try:
        data = path.read_bytes()
        n = int.from_bytes(data[8:12], "little")
        header = msgpack.unpackb(data[12:12 + n])
        decode(data, header["hash"], header["tokens"], [a[0] for a in header["arrays"]])
    except (OSError, ValueError, BlockFileError):
        return False
    return len(data) == size


def _tokens(path: Path, msgpack) -> list:
    data = path.read_bytes()
    n = int.from_bytes(data[8:12], "little")
    return list(msgpack.unpackb(data[12:12 + n])["tokens"])
