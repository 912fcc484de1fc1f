"""Which Ray cluster a topology's `[ray] address` means, so that nothing stale redirects `up`, `status` or `down`.

Ray keeps a record of the last `ray start` on a machine, `ray_current_cluster` in its temp folder (/tmp/ray
unless RAY_TMPDIR says otherwise), and reads it whenever a call is given no address: `ray.init()` without
one, `"auto"`, and the state API (`ray.util.state.list_actors()` and friends), which looks the record up on
every call even while the driver is connected elsewhere. A head that stopped without `ray stop` leaves the
record behind, so such a call goes to an address where nothing runs and waits there for minutes. Hence:

- `resolve`: "HOST:PORT" is used as written; "auto" means the Ray head this machine runs or has joined,
  RAY_ADDRESS when set (Ray's own rule), else the one live GCS address among this machine's Ray processes
  (the record only picks among live ones, so a stale record never wins);
- `check_reachable`: a TCP connect with a deadline before `ray.init`, which would otherwise retry an address
  that answers nothing for minutes; the error is one line naming the address;
- `connected_state_api`: the state API's calls get the GCS address of the cluster this process is connected
  to, with RAY_ADDRESS / RAY_API_SERVER_ADDRESS (which Ray lets override even an explicit address) set
  aside for the call.

`mlx-pd down` of a local head also removes the record when it names that head (`ray_head.forget_ray_address`).
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator

ENV_OVERRIDES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")


def resolve(address: str) -> str:
    """The GCS address ("HOST:PORT", or a "ray://" client address) that `[ray] address` (not "local") means;
    see the module docstring for "auto". ConnectionError (one line) when "auto" finds no head or several."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private.services import find_gcs_addresses
    from ray._private.utils import read_ray_address

    live = sorted(find_gcs_addresses())
    recorded = read_ray_address()
    if recorded in live:
        return recorded
    if len(live) == 1:
        return live[0]
    if not live:
        raise ConnectionError('[ray] address = "auto" finds no Ray running on this machine: start the head '
                              '(`ray start --head`) or join one, or set [ray] address = "HOST:6379"')
    raise ConnectionError(f'[ray] address = "auto" finds several Ray clusters on this machine ({", ".join(live)}): '
                          "set [ray] address to the one to use")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Connect to `address` ("HOST:PORT", "[v6]:PORT" or "ray://HOST:PORT") over TCP within `timeout_s`.
    ConnectionError (one line naming the address and the cause) when nothing answers there."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except ValueError:
        raise ConnectionError(f"[ray] address {address!r} is invalid: write it as HOST:PORT") from None
    except OSError as exc:
        cause = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or type(exc).__name__)
        raise ConnectionError(f"cannot reach the Ray head at {address} ({cause}): is `ray start --head` "
                              "running there, and is [ray] address right?") from None


@contextmanager
def connected_state_api() -> Iterator[str]:
    """Yield the GCS address of the cluster this process is connected to (`ray.init` first), for the state
    API's `address=`, with Ray's environment overrides of that address set aside until the block ends."""
    import ray

    address = ray.get_runtime_context().gcs_address
    saved = {name: os.environ.pop(name) for name in ENV_OVERRIDES if name in os.environ}
    try:
        yield address
    finally:
        os.environ.update(saved)
