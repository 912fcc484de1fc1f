"""The grammar mask's cost per decode step measured alone, apart from the model (`mlx-pd bench structured`).

The constrained outputs of a benchmark run are replayed through fresh llguidance matchers (one per row, over
the engine's own llguidance tokenizer, so the engine's counters do not move) and at every step the three
parts of what constrained decoding adds to a step are timed as the engine runs them (cluster/grammar.py,
cluster/sampling.py): filling the int32 bitmask of all rows one matcher after another, unpacking it into bool
[R, V] rows on the host (`Grammars.unpack`), and applying the rows in `sample` (the time of a greedy `sample`
over the batch with the masks, less the same without them, on fixed random logits). Beside them, the same
unpack written independently with NumPy (`numpy_unpack`, checked equal to `Grammars.unpack` on every step).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence


def numpy_unpack(bitmask, vocab_size: int):
    """int32 [R, W] llguidance bitmask (bit t of word w allows token 32w + t) -> bool numpy [R, vocab_size],
    on the host: the words' little-endian bytes unpacked least significant bit first."""
    import numpy as np

    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(np.bool_)


def mask_alone(grammars, grammar: str, outputs: Sequence[Sequence[int]]) -> dict:
    """Replay `outputs` (each row's output token ids, all generated under `grammar`) through fresh matchers of
    `grammars` (a `cluster.grammar.Grammars` whose tokenizer is built) and time, per step of all rows: the
    bitmask fill, the unpack and the mask's share of `sample`, in ms. The first output token is consumed
    before the first step (it was sampled with the prompt). Returns {"rows", "steps", "fill_ms_p50",
    "unpack_ms_p50", "apply_ms_p50", "total_ms_p50" (the sum of the three medians), "fill_ms_per_row",
    "numpy_unpack_ms_p50" (`numpy_unpack` and its copy into an mlx array)}. Raises RuntimeError when the
    grammar refuses a replayed token or the two unpacks differ."""
    import llguidance
    import llguidance.numpy as llg_numpy
    import mlx.core as mx

    from cluster.request import SamplingParams
    from cluster.sampling import sample

    rows, vocab = len(outputs), grammars.vocab_size
    matchers = [llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0) for _ in outputs]
    for m, toks in zip(matchers, outputs):
        m.consume_tokens(list(toks[:1]))
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0))
    mx.eval(logits)
    params, empty, keys = [SamplingParams(max_tokens=1, temperature=0)] * rows, [()] * rows, [None] * rows
    fill, unpack, apply, host = [], [], [], []
    steps = min(len(t) for t in outputs) - 1 if outputs else 0
    for t in range(1, steps + 1):
        start = time.perf_counter()
        bitmask = llg_numpy.allocate_token_bitmask(rows, vocab)
        for r, m in enumerate(matchers):
            llg_numpy.fill_next_token_bitmask(m, bitmask, r)
        filled = time.perf_counter()
        unpacked = grammars.unpack(bitmask)
        unpacked_at = time.perf_counter()
        sample(logits, params, empty, empty, keys, unpacked)
        masked = time.perf_counter()
        sample(logits, params, empty, empty, keys, None)
        free = time.perf_counter()
        on_host = mx.array(numpy_unpack(bitmask, vocab))
        host.append(time.perf_counter() - free)
        if not mx.array_equal(on_host, unpacked).item():
            raise RuntimeError(f"step {t}: the host unpack differs from Grammars.unpack")
        fill.append(filled - start)
        unpack.append(unpacked_at - filled)
        apply.append((masked - unpacked_at) - (free - masked))
        for m, toks in zip(matchers, outputs):
            if not m.consume_token(toks[t]):
                raise RuntimeError(f"replaying step {t}: the grammar refuses token {toks[t]}: {m.get_error()}")
    ms = {name: 1000 * statistics.median(v) if v else None
          for name, v in (("fill_ms_p50", fill), ("unpack_ms_p50", unpack), ("apply_ms_p50", apply))}
    total = sum(ms.values()) if steps else None
    return {"rows": rows, "steps": steps, **ms, "total_ms_p50": total,
            "fill_ms_per_row": ms["fill_ms_p50"] / rows if steps else None,
            "numpy_unpack_ms_p50": 1000 * statistics.median(host) if host else None}
