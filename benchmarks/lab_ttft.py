"""TTFT of 2k-token prompts on a 1P2D lab over a shaped link, per KV format on the wire.

    mlx-pd bench lab-ttft --rate 1gbit --prompts 4          # root, Linux: builds a lab per format

For each KV format (float32, the model's dtype; 8-bit and 4-bit with group 64) a lab of its own
(benchmarks/lab: the studio prefills, two minis decode, links shaped to `--rate`, CurveZMQ on, SmolLM2-135M at
float32 compute so only the KV format differs) serves `--prompts` unique prompts of `--prompt-tokens` tokens
(chat template included), one at a time, each streaming `--max-tokens` tokens, sent from the client host. One
unmeasured prompt goes first. Per request the client records:

    TTFT           send -> the first token (computed by the prefill worker, forwarded by the router at once)
    second token   send -> the second token: the decode worker's first, after the prompt's KV crossed the link
    handoff        second token - TTFT: the KV's transfer left exposed after the prefill, plus one decode step

and the prefill worker's KV bytes sent per request (its `kv_bytes_sent` from the router's dashboard state).
The prompt is one 2048-token prefill chunk, so its KV ships when the chunk is done: the whole transfer is
exposed, the case where the wire format matters most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

FORMATS = (("float32", None), ("8-bit g64", 8), ("4-bit g64", 4))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="1gbit", help="every host's link, in tc's units (default 1gbit)")
    p.add_argument("--prompts", type=int, default=4, help="measured prompts per format (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt (default 2048)")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request (default 4)")
    p.add_argument("--model", default="default", help='the lab\'s model: "default" (SmolLM2-135M) or "fast"')
    p.add_argument("--root", default="/tmp/mlxpd-lab-ttft", help="the labs' folder")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown")


def client(url: str, key: str, prompts_file: str, model: str, max_tokens: int) -> int:
    """Run in the client host: each prompt of `prompts_file` (a JSON list) in turn, streaming; prints one JSON
    line per request: ttft_s, second_s, tokens, error."""
    import httpx

    from benchmarks.sse import SSEParser, parse_chunk

    for prompt in json.loads(Path(prompts_file).read_text()):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": True, "temperature": 0, "ignore_eos": True}
        times, error, parser = [], None, SSEParser()
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
            else:
                for line in r.iter_lines():
                    for data in parser.feed(line):
                        chunk = parse_chunk(data)
                        if chunk.error:
                            error = str(chunk.error)
                        elif chunk.content:
                            times.append(time.perf_counter() - t0)
        print(json.dumps({"ttft_s": times[0] if times else None, "second_s": times[1] if len(times) > 1 else None,
                          "tokens": len(times), "error": error}), flush=True)
    return 0


def _prompts(n: int, tokens: int, tag: str) -> list[str]:
    from benchmarks.engine_pair import chat_token_counter, long_prompt
    from cluster.model import resolve_model_path

    count = chat_token_counter(str(resolve_model_path(None, dtype="float32")))
    return [long_prompt(tokens, f"{tag}-{i}", count) for i in range(n)]


def _kv_bytes_sent(lab) -> int:
    """The prefill worker's KV bytes sent so far, from the router's dashboard state (read in the client host)."""
    code = ("import json, os, httpx; r = httpx.get(os.environ['OPENAI_BASE_URL'][:-3] + '/dashboard/api/state', "
            "headers={'Authorization': 'Bearer ' + os.environ['MLX_PD_API_KEY']}, timeout=30); "
            "print(json.dumps([w for w in r.json()['workers']]))")
    out = lab.run("client", [sys.executable, "-c", code], capture_output=True, text=True, timeout_s=60)
    workers = json.loads(out.stdout.strip().splitlines()[-1])
    return sum(int(w.get("kv_bytes_sent") or 0) for w in workers if w.get("role") == "prefill")


def one_format(args, label: str, kv_bits: Optional[int], log) -> dict:
    """A lab with this KV format, its prompts, its figures."""
    from benchmarks.lab import Lab

    root = Path(args.root)
    prompts = _prompts(args.prompts + 1, args.prompt_tokens, label.split()[0])
    with Lab(root, minis=2, rate=args.rate, model=args.model, engine={"kv_bits": kv_bits} if kv_bits else {},
             echo=lambda m: None) as lab:
        t0 = time.monotonic()
        lab.up(timeout_s=600)
        log(f"  lab up in {time.monotonic() - t0:.0f} s")
        warm, measured = root / "warm.json", root / "prompts.json"
        warm.write_text(json.dumps(prompts[:1]))
        measured.write_text(json.dumps(prompts[1:]))
        env = lab.env()
        served = lab.state.served_name
        cmd = [sys.executable, "-m", "benchmarks.lab_ttft", "client", "--url", env["OPENAI_BASE_URL"],
               "--key", env["MLX_PD_API_KEY"], "--model", served, "--max-tokens", str(args.max_tokens)]
        lab.run("client", cmd + ["--prompts-file", str(warm)], capture_output=True, text=True, timeout_s=900)
        before = _kv_bytes_sent(lab)
        out = lab.run("client", cmd + ["--prompts-file", str(measured)], capture_output=True, text=True,
                      timeout_s=1800)
        sent = _kv_bytes_sent(lab) - before
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    ok = [r for r in rows if not r["error"] and r["second_s"] is not None]
    med = (lambda key: statistics.median(r[key] for r in ok) if ok else None)
    result = {"requests": rows, "errors": len(rows) - len(ok), "ttft_s": med("ttft_s"), "second_s": med("second_s"),
              "kv_mb_per_request": sent / max(1, len(rows)) / 1e6}
    result["handoff_s"] = statistics.median(r["second_s"] - r["ttft_s"] for r in ok) if ok else None
    return result


def run(args, log=None) -> dict:
    """`mlx-pd bench lab-ttft`: a lab per KV format; JSON-ready result."""
    from benchmarks.compare import machine_info

    if args.prompts < 1 or args.max_tokens < 2:
        raise ValueError("--prompts must be >= 1 and --max-tokens >= 2 (the second token is the decode worker's)")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    result = {"kind": "lab-ttft", "machine": machine_info(), "rate": args.rate, "model": args.model,
              "prompt_tokens": args.prompt_tokens, "prompts": args.prompts, "formats": {}}
    for label, bits in FORMATS:
        log(f"{label}: a 1P2D lab at {args.rate}, {args.prompts} prompts of {args.prompt_tokens} tokens")
        result["formats"][label] = one_format(args, label, bits, log)
        f = result["formats"][label]
        log(f"  TTFT {f['ttft_s']}, second token {f['second_s']}, {f['kv_mb_per_request']:.1f} MB of KV a request")
    result["errors"] = sum(f["errors"] for f in result["formats"].values())
    from benchmarks.prefix_report import markdown

    print(markdown(tables(result)))
    return result


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = [[label, f"{f['kv_mb_per_request']:.1f}", _ms(f["ttft_s"]), _ms(f["second_s"]), _ms(f["handoff_s"]),
             str(f["errors"])] for label, f in result["formats"].items()]
    title = (f"1P2D lab, {result['rate']} links, {result['prompts']} prompts of {result['prompt_tokens']} tokens "
             f"({result['model']} model, float32 compute), medians")
    return [(title, ["KV on the wire", "KV MB a request", "TTFT ms", "second token ms", "handoff ms", "errors"],
             rows)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m benchmarks.lab_ttft")
    p.add_argument("kind", choices=["client"])
    p.add_argument("--url", required=True)
    p.add_argument("--key", default="")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=4)
    a = p.parse_args()
    sys.exit(client(a.url, a.key, a.prompts_file, a.model, a.max_tokens))
