"""A lab of Macs on one Linux machine: network namespaces as hosts, Ray across them, mlx-pd on top.

A studio (prefill, router, Ray head), N minis (decode, Ray nodes) and a client are network namespaces on one
bridge, each link shaped with tbf to a rate (net.py); Ray runs in each host as on a Mac of a real lab
(ray_hosts.py); the topology has topologies/lab-example.toml's shape on the lab's addresses (topology.py);
`Lab` (lab.py) brings it all up and tears down exactly what it started; `scripts/lab` is its command
(cli.py). Linux, as root, with iproute2 only. See README.md, "A lab without Macs", and docs/DESIGN.md.
"""

from benchmarks.lab.lab import Lab
from benchmarks.lab.net import LabError

__all__ = ["Lab", "LabError"]
