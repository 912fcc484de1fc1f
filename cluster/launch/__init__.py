"""The roof: everything that wires the house together into running processes.

    cli.py          the `mlx-pd` command (serve, generate, keys, up/status/down, worker/router; bench and
                    profile hand over to the benchmarks tool when it is installed)
    single_node.py  single-node mode: a decode worker over an in-process channel behind `InProcessEngineClient`
                    (`mlx-pd serve`)
    processes.py    cluster mode without Ray: one worker or the router in this process
    ray_up.py       cluster mode on Ray: `up`, `status`, `down` of a topology
    ray_driver.py   the Ray calls `ray_up` makes while connected (create, watch and remove actors)
    ray_head.py     the local Ray head and Ray's token authentication
    actors.py       what runs inside the Ray actors (WorkerActor, RouterActor, metrics export)
    workers.py      make_worker (the worker class of a role) and probe_worker (one ping)
    platform.py     process-level platform quirks: the OpenBLAS preload/re-exec, CPU pinning

This is the only part of `cluster/` that imports sibling packages (router, prefill_node, decode_node,
kv_transfer) and the only one that imports `ray`; every other module of `cluster/` is ground floor and
imports none (DESIGN §3, tests/test_dependency_rule.py). This file imports nothing, so that
`python -m cluster.launch.cli` can re-execute itself with OpenBLAS preloaded before MLX is loaded.
"""
