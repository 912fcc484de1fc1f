"""The KV wing: blocks, pools, KV cache groups, stores and layouts, cache views, hashing, recurrent state and
its snapshots. It imports nothing of the engine (cluster/engine.py, scheduler, sequence)."""
