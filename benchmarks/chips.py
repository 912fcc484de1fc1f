"""Peak figures of the machine a profile runs on: a table of Apple chips, or a measurement here.

**Memory bandwidth** (GB/s = 10^9 bytes/s) is Apple's own figure from its spec pages and press releases
(apple.com/newsroom, "Apple unveils M1 Pro and M1 Max", "M2 Pro and M2 Max", "M3 family", "M4 Pro and M4
Max", Mac Studio M3 Ultra, ...). Where one chip name ships in two memory configurations (M3 Max, M4 Max),
the smaller GPU bins come with the narrower bus, and the table lists both. The base M1's 68.25 GB/s is
its LPDDR4X-4266 on a 128-bit bus (Apple gives no number).

**GPU FP32 TFLOPS**: Apple publishes none for most chips. The table uses the figures commonly published
for the full chips (Wikipedia's Apple silicon pages and the public tables that copy them: M1 2.6, M2 3.6,
M3 4.1, M4 4.6 TFLOPS for 10 (M1: 8) GPU cores), scaled by GPU core count within a generation (the
clock is the same across a generation's dies, to within a few percent); an Ultra is two Max dies. These
are marked approximate: GPU cores x 128 FP32 ALUs x 2 FLOPs (FMA) x clock, and the clocks are not
official. Apple GPUs of M1-M4 run FP16/BF16 arithmetic at the FP32 rate, so the same peak serves every
dtype mlx-pd uses.

Off the table (any Linux machine, or an unknown chip), :func:`measure_peaks` measures a float32 MLX matmul
(GFLOP/s) and a large MLX array copy (GB/s, bytes read + written) on the default device: the achievable
peak of *this* machine as MLX sees it, not a datasheet figure.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Optional

# GPU FP32 TFLOPS per GPU core, per generation (full-chip published figure / its core count; see above)
TFLOPS_PER_CORE = {"M1": 2.6 / 8, "M2": 3.6 / 10, "M3": 4.1 / 10, "M4": 4.6 / 10}

# (chip name, GPU cores, memory bandwidth GB/s): every shipped GPU bin of M1-M4 and their Pro/Max/Ultra
_BINS = [
    ("M1", 7, 68.25), ("M1", 8, 68.25), ("M1 Pro", 14, 200), ("M1 Pro", 16, 200), ("M1 Max", 24, 400),
    ("M1 Max", 32, 400), ("M1 Ultra", 48, 800), ("M1 Ultra", 64, 800),
    ("M2", 8, 100), ("M2", 10, 100), ("M2 Pro", 16, 200), ("M2 Pro", 19, 200), ("M2 Max", 30, 400),
    ("M2 Max", 38, 400), ("M2 Ultra", 60, 800), ("M2 Ultra", 76, 800),
    ("M3", 8, 100), ("M3", 10, 100), ("M3 Pro", 14, 150), ("M3 Pro", 18, 150), ("M3 Max", 30, 300),
    ("M3 Max", 40, 400), ("M3 Ultra", 60, 819), ("M3 Ultra", 80, 819),
    ("M4", 8, 120), ("M4", 10, 120), ("M4 Pro", 16, 273), ("M4 Pro", 20, 273), ("M4 Max", 32, 410),
    ("M4 Max", 40, 546),
]


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s and memory bandwidth (bytes/s) of a machine, and where they come from."""

    flops: float
    bandwidth_bytes_per_s: float
    source: str  # "table: Apple M2 Max, 38-core GPU" or "measured: ..."
    chip: Optional[str] = None
    gpu_cores: Optional[int] = None
    approximate_flops: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def table_peak(chip: str, gpu_cores: Optional[int] = None) -> Optional[Peak]:
    """The table's figures for `chip` ("M2 Max", "Apple M2 Max"); `gpu_cores` picks the bin (default: the
    largest bin of that chip). None when the chip is not in the table."""
    name = re.sub(r"^Apple\s+", "", chip.strip())
    bins = [b for b in _BINS if b[0].lower() == name.lower()]
    if not bins:
        return None
    match = [b for b in bins if b[1] == gpu_cores] or [max(bins, key=lambda b: b[1])]
    name, cores, gbs = match[0]
    tflops = TFLOPS_PER_CORE[name.split()[0]] * cores
    return Peak(flops=tflops * 1e12, bandwidth_bytes_per_s=gbs * 1e9, chip=f"Apple {name}", gpu_cores=cores,
                source=f"table: Apple {name}, {cores}-core GPU ({gbs:g} GB/s from Apple; "
                       f"~{tflops:.1f} FP32 TFLOPS as commonly published, approximate)")


def table_rows() -> list[dict]:
    """Every bin of the table as {chip, gpu_cores, bandwidth_gbs, fp32_tflops} (for the docs)."""
    return [{"chip": f"Apple {n}", "gpu_cores": c, "bandwidth_gbs": g,
             "fp32_tflops": round(TFLOPS_PER_CORE[n.split()[0]] * c, 2)} for n, c, g in _BINS]


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def detect_chip() -> tuple[Optional[str], Optional[int]]:
    """(chip name like "Apple M2 Max", GPU cores) of this Mac; (None, None) elsewhere or when unknown.

    Reads ``sysctl -n machdep.cpu.brand_string`` and the GPU core count from ``system_profiler
    SPDisplaysDataType -json`` (``sppci_cores``)."""
    if platform.system() != "Darwin":
        return None, None
    brand = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip() or None
    cores = None
    try:
        displays = json.loads(_run(["system_profiler", "SPDisplaysDataType", "-json"]) or "{}")
        for gpu in displays.get("SPDisplaysDataType", []):
            if str(gpu.get("sppci_cores", "")).isdigit():
                cores = int(gpu["sppci_cores"])
                break
    except ValueError:
        pass
    return brand, cores


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(matmul_n: int = 2048, copy_mib: int = 512, repeats: int = 5) -> Peak:
    """Measure this machine's peaks with MLX on its default device (float32, best of `repeats` after one
    warm-up each).

    FLOP/s: ``a @ b`` for two [n, n] float32 matrices, 2 n^3 FLOPs. Bandwidth: ``a + 0`` over a
    `copy_mib` MiB float32 array, counted as its bytes read plus written (STREAM's "copy" convention).
    MLX's buffer cache is raised for the copy (and restored): under its 32 MiB default on the CPU backend
    every large result lands in freshly faulted pages, which measured 3.7 GB/s here against 24-28 GB/s
    with the cache (and NumPy's `copyto`): that is the page-fault rate, not the memory's.
    """
    import mlx.core as mx

    a = mx.random.normal((matmul_n, matmul_n))
    b = mx.random.normal((matmul_n, matmul_n))
    mx.eval(a, b)
    mx.eval(a @ b)
    t_mm = _best_seconds(lambda: mx.eval(a @ b), repeats)
    x = mx.random.normal((copy_mib * 2**20 // 4,))
    mx.eval(x)
    previous = mx.set_cache_limit(4 * x.nbytes)
    try:
        mx.eval(x + 0)
        t_cp = _best_seconds(lambda: mx.eval(x + 0), repeats)
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()
    flops = 2 * matmul_n**3 / t_mm
    bw = 2 * x.nbytes / t_cp
    return Peak(flops=flops, bandwidth_bytes_per_s=bw, approximate_flops=False,
                source=f"measured: MLX float32 {matmul_n}x{matmul_n} matmul {flops / 1e9:.0f} GFLOP/s, "
                       f"{copy_mib} MiB copy {bw / 1e9:.1f} GB/s on {mx.default_device()}")


def machine_peak(chip: Optional[str] = None, gpu_cores: Optional[int] = None, measure: bool = True) -> Peak:
    """The peak to judge measurements against: the table's figures for `chip` (default: the detected chip),
    else (Linux, unknown chips) a measurement here when `measure`. Raises ValueError for a `chip` given
    by name that the table lacks."""
    if chip is not None:
        peak = table_peak(chip, gpu_cores)
        if peak is None:
            names = sorted({b[0] for b in _BINS})
            raise ValueError(f"chip {chip!r} is not in the table; known: {', '.join(names)}")
        return peak
    brand, cores = detect_chip()
    peak = table_peak(brand, cores) if brand else None
    if peak is not None:
        return peak
    if not measure:
        raise ValueError("this machine is not in the chip table; give --chip or let it measure")
    return measure_peaks()
