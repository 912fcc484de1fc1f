"""Worker groups: N ranks (one process each, normally one per Mac) that act as one prefill or decode worker.

One rank leads: it runs the whole engine (scheduler, KV manager, sockets) and, before each forward, hands the
followers that forward's batch items (`step_wire.py`), so every rank runs the same forward over its shard of
the model and of the KV while MLX's collectives join them (`collective.py`). Every rank watches the others'
heartbeats and ends the group past a deadline (`heartbeat.py`), because a collective takes no timeout.
"""
