"""Free ports for configurations written before anything binds them: one call never repeats a port."""

import socket

from cluster.ports import free_ports


def test_ports_chosen_together_are_distinct_and_bindable():
    """A test cluster's topology takes seven or more ports in one go; choosing them one at a time once gave
    the same port to two workers (the kernel handed a just-released port out again). Ports asked for
    together are all different, and each can be bound and listened on."""
    ports = free_ports(64)
    assert len(set(ports)) == 64
    held = []
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        for s in held:
            s.close()


def test_an_excluded_range_is_never_returned():
    """A range to avoid (Ray's worker ports, for a local Ray head) is skipped, whatever the kernel offers."""
    lo, hi = 32768, 48000
    assert all(not lo <= p <= hi for p in free_ports(16, exclude=(lo, hi)))
