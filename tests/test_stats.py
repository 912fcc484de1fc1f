"""The stats object (cluster/stats.py), its KV cache group records (`KVManager.group_stats`) and the one table
of metric names (cluster/stats_metrics.py) that the router's /metrics and the Ray worker actors both export."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from cluster.kv.attention_groups import FullAttentionGroup, SlidingWindowGroup
from cluster.kv.block_pool import BlockPool
from cluster.kv.manager import KVManager
from cluster.kv.state_group import RecurrentStateGroup
from cluster.launch import actors
from cluster.protocol import PROTOCOL_VERSION, TO_ROUTER, Pong, ProtocolError, pack, to_wire, unpack
from cluster.stats import EngineStats, KVGroupStats, LoadCheckReport, WorkerStats
from cluster.stats_metrics import GROUP_METRICS, METRICS, exported_names
from kv_transfer.metrics import TransferMetrics
from router.metrics import RouterMetrics

# a decode worker's report with every figure set, groups of both shapes (blocks; entries and bytes)
REPORT = WorkerStats(
    name="decode-0", actor="decode-0@127.0.0.1", role="decode", host="127.0.0.1", num_running=2, num_waiting=1,
    kv_block_size=16, num_preemptions=3, prefix_cache_queries=40, prefix_cache_hits=10, num_draft_tokens=8,
    num_accepted_tokens=6, constrained_requests=1, grammar_mask_seconds=0.5, tokens_out=99, requests=3,
    transfers_inflight=1, awaiting_kv=1, orphans=0, handed_off=0, transfers_pending=0, kv_bytes_sent=0.0,
    kv_blocks_sent=0.0, kv_bytes_received=4096.0, kv_blocks_received=4.0, transfer_timeouts=1.0,
    reservations_busy=2.0, ttft_p50_s=0.25,
    load_check=LoadCheckReport("llama", ("output head equals the model's own call", "prefix hit reusing 64 tokens"),
                               0.42),
    kv_groups=(KVGroupStats("full", blocks_total=100, blocks_free=60),
               KVGroupStats("recurrent", entries=2, bytes_used=512, budget_bytes=4096, restores=1, bytes_sent=0.0,
                            bytes_received=256.0)))


class _Engine:
    """An engine client whose only worker is `REPORT`'s."""

    def __init__(self, reports):
        self.reports = reports

    def stats(self) -> EngineStats:
        return EngineStats.from_reports(self.reports)

    def is_healthy(self) -> bool:
        return True


def _router_series(reports) -> dict[tuple[str, tuple], float]:
    """(series name, labels) -> value of the engine figures the router's /metrics exposes."""
    registry = RouterMetrics(_Engine(reports)).registry
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect()
            for s in m.samples if s.name.startswith("mlx_pd_")}


def _router_families(reports) -> set[str]:
    """The engine metric names the router's /metrics declares (a counter's with `_total`)."""
    registry = RouterMetrics(_Engine(reports)).registry
    return {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()
            if m.name.startswith("mlx_pd_")}


class _RayMetric:
    """Stands in for ray.util.metrics.Gauge / Counter (they need a running Ray): records what the exporter
    declares and sets; Ray shows it as `ray_<name>`, a counter with `_total`."""

    made: list["_RayMetric"] = []

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.description, self.tag_keys, self.values = name, description, tuple(tag_keys), {}
        _RayMetric.made.append(self)

    def set(self, value, tags):
        self.values[tuple(sorted(tags.items()))] = value

    def inc(self, value, tags):
        key = tuple(sorted(tags.items()))
        self.values[key] = self.values.get(key, 0.0) + value


class _RayGauge(_RayMetric):
    suffix = ""


class _RayCounter(_RayMetric):
    suffix = "_total"


@pytest.fixture
def ray_exporter(monkeypatch):
    import ray.util.metrics

    _RayMetric.made = []
    monkeypatch.setattr(ray.util.metrics, "Gauge", _RayGauge)
    monkeypatch.setattr(ray.util.metrics, "Counter", _RayCounter)
    exporter = actors.MetricsExporter(lambda: REPORT, "decode-0", "decode")
    exporter.export(None)
    return _RayMetric.made


def pack_raw(message: dict) -> bytes:
    import msgpack

    return msgpack.packb(message, use_bin_type=True)


def test_a_report_crosses_the_wire_as_it_is():
    """A worker's report, KV cache group records included, comes out of a pong frame equal to what went in;
    a figure of the wrong type or an unknown field is refused by name."""
    got = unpack(pack(Pong(seq=1, stats=REPORT)), TO_ROUTER, PROTOCOL_VERSION)
    assert got.stats == REPORT and got.stats.kv_blocks_free == 60 and got.stats.kv_groups[1].group == "recurrent"
    wire = to_wire(REPORT)
    with pytest.raises(ProtocolError, match="num_running"):
        unpack(pack_raw({"type": "pong", "version": 1, "seq": 1, "stats": {**wire, "num_running": "2"}}),
               TO_ROUTER, PROTOCOL_VERSION)
    groups = [{**wire["kv_groups"][0], "kind": "x"}]
    with pytest.raises(ProtocolError, match="unknown field"):
        unpack(pack_raw({"type": "pong", "version": 1, "seq": 1, "stats": {**wire, "kv_groups": groups}}),
               TO_ROUTER, PROTOCOL_VERSION)


def test_a_load_check_crosses_the_wire_and_a_wrong_one_is_refused_by_name():
    """The load check a worker reports reaches the router as it went out (a report without one as null); a
    passed check that is not a string, a negative cost or an unknown key is refused naming the field."""
    got = unpack(pack(Pong(seq=1, stats=REPORT)), TO_ROUTER, PROTOCOL_VERSION).stats.load_check
    assert got == REPORT.load_check and got.passed[1] == "prefix hit reusing 64 tokens" and not got.skipped
    assert unpack(pack(Pong(seq=2, stats=WorkerStats())), TO_ROUTER, PROTOCOL_VERSION).stats.load_check is None
    assert REPORT.report()["load_check"] == {"model_type": "llama", "passed": list(REPORT.load_check.passed),
                                             "seconds": 0.42, "skipped": False}
    wire = to_wire(REPORT)
    for bad, where in (({"passed": ["ok", 3]}, "load_check.passed\\[1\\] must be a string"),
                       ({"seconds": -1.0}, "seconds=-1.0 must be a finite number >= 0"),
                       ({"verified": True}, "unknown field")):
        stats = {**wire, "load_check": {**wire["load_check"], **bad}}
        with pytest.raises(ProtocolError, match=where):
            unpack(pack_raw({"type": "pong", "version": 1, "seq": 1, "stats": stats}), TO_ROUTER, PROTOCOL_VERSION)


def test_engine_stats_add_up_groups_by_name_with_blocks_from_decode_workers():
    """The sum over workers keeps each KV cache group once, by name: its blocks are the decode workers' (a
    prefill worker's are transient), its other figures everyone's; field names are the report's."""
    prefill = WorkerStats(role="prefill", num_waiting=2, prefix_cache_hits=5, ttft_p50_s=0.5,
                          kv_groups=(KVGroupStats("full", blocks_total=50, blocks_free=10),
                                     KVGroupStats("recurrent", entries=1, bytes_used=100, bytes_sent=256.0)))
    total = EngineStats.from_reports([prefill, REPORT])
    assert (total.kv_blocks_total, total.kv_blocks_free, total.kv_blocks_used) == (100, 60, 40)
    assert [g.group for g in total.kv_groups] == ["full", "recurrent"]
    recurrent = total.kv_groups[1]
    assert (recurrent.entries, recurrent.bytes_used, recurrent.bytes_sent, recurrent.bytes_received) == \
        (3, 612, 256.0, 256.0)
    assert total.num_waiting == 3 and total.prefix_cache_hits == 15 and total.ttft_p50_s == 0.5
    assert total.num_running == 2 and total.constrained_requests == 1  # the decode worker's only
    assert EngineStats.from_reports([]).kv_blocks_total == 0


def test_kv_group_stats_reads_the_pools_and_the_saved_states():
    """One record per KV cache group of an engine: the pool first, the window pool's blocks when it has one,
    the saved states' count, bytes, budget, restores and the state bytes its transfers moved."""
    store = SimpleNamespace(block_size=4)
    main, window = BlockPool(11), BlockPool(7, group=1)
    main.allocate(6)
    snaps = type("Snaps", (), {"__len__": lambda self: 3, "nbytes": 300, "budget_bytes": 1000, "num_restored": 2})()
    kv = KVManager([FullAttentionGroup(main, store, [0]), SlidingWindowGroup(window, store, [1], 8),
                    RecurrentStateGroup((), main, snaps)], 4)
    sent = TransferMetrics("send")
    sent.moved_state(128)
    assert kv.group_stats(sent) == (
        KVGroupStats("full", blocks_total=10, blocks_free=4),
        KVGroupStats("sliding_window", blocks_total=6, blocks_free=6),
        KVGroupStats("recurrent", entries=3, bytes_used=300, budget_bytes=1000, restores=2, bytes_sent=128.0))
    plain = KVManager([FullAttentionGroup(BlockPool(11), store, [0])], 4)
    assert plain.group_stats() == (KVGroupStats("full", blocks_total=10, blocks_free=10),)


def test_the_table_names_every_figure_once():
    """Every figure of the stats has exactly one metric, and no two metrics share a name."""
    specs = [*METRICS, *GROUP_METRICS]
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.field for s in METRICS}) == len(METRICS)
    assert len({s.field for s in GROUP_METRICS}) == len(GROUP_METRICS)
    figures = {f for f in EngineStats.__dataclass_fields__} - {"kv_groups"}
    assert figures <= {s.field for s in METRICS}
    assert {f for f in KVGroupStats.__dataclass_fields__} - {"group"} <= {s.field for s in GROUP_METRICS}
    assert all(re.fullmatch(r"mlx_pd_[a-z0-9_]+", s.name) for s in specs)
    assert not [s.name for s in specs if s.kind == "counter" and s.name.endswith("_total")]  # the suffix is added


def test_router_and_ray_export_one_prometheus_name_per_figure(ray_exporter):
    """The router's /metrics (the sum over workers) and a Ray worker actor (its own report) export the same
    metric names, once Ray's `ray_` prefix is taken off: one name, one type and one help text per figure; for a
    topology of one decode worker they also carry the same values, KV cache groups labelled `group`."""
    router = _router_families([REPORT])
    ray = {("ray_" + m.name + m.suffix).removeprefix("ray_") for m in ray_exporter}
    assert router == ray == exported_names()
    assert len(ray_exporter) == len({m.name for m in ray_exporter})  # each declared once
    kinds = {m.name: ("counter" if isinstance(m, _RayCounter) else "gauge") for m in ray_exporter}
    helps = {m.name: m.description for m in ray_exporter}
    assert all(kinds[s.name] == s.kind and helps[s.name] == s.help for s in (*METRICS, *GROUP_METRICS))

    ray_values = {}
    for m in ray_exporter:
        for tags, value in m.values.items():
            labels = tuple((k, v) for k, v in tags if k not in ("worker", "role"))
            assert dict(tags)["worker"] == "decode-0" and dict(tags)["role"] == "decode"
            ray_values[(m.name + m.suffix, labels)] = value
    # Ray's counters show once they grow: compare the figures that are not 0
    assert {k: v for k, v in _router_series([REPORT]).items() if v} == {k: v for k, v in ray_values.items() if v}
    assert ray_values[("mlx_pd_kv_group_entries", (("group", "recurrent"),))] == 2
    assert ray_values[("mlx_pd_kv_group_blocks_used", (("group", "full"),))] == 40
    assert ("mlx_pd_kv_group_entries", (("group", "full"),)) not in ray_values  # not a figure of that group
