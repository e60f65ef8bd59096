"""A real sidecar's replay socket flooded with requests: the local API still answers
(tests/unit/test_kvevents_limits.py checks the replay loop itself)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.errors import KVPoolError
from kvpool_sidecar.process import SidecarProcess
from tests.integration.kv_subscriber import kv_config
from tests.integration.support import DEADLINE_S, fresh_keys

pytestmark = pytest.mark.integration

#: How long the vLLM and SGLang connectors wait for the sidecar.
CONNECTOR_DEADLINE_S = 1.0

#: Sends replay requests as fast as ZMQ takes them, on one DEALER that never reads: for
#: nothing kept, malformed, with a short sequence, and from sequence 0, in turn.
FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.SNDHWM, 100000)
d.connect(sys.argv[1])
requests = [[b"", ((1 << 63) - 1).to_bytes(8, "big")], [b"x"], [b"", b"\\x01"], [b"", bytes(8)]]
n = 0
print("flooding", flush=True)
while True:
    try:
        d.send_multipart(requests[n % len(requests)], flags=zmq.NOBLOCK)
        n += 1
    except zmq.Again:
        time.sleep(0.0005)
"""


def test_a_flood_of_replay_requests_leaves_the_local_api_answering(
        sidecar_factory: Callable[..., SidecarProcess]) -> None:
    """pyzmq's receive completes at once while requests wait, and the replay loop had never
    given the event loop a turn while they came: during a flood every lookup timed out."""
    sp = sidecar_factory({"kv_events": kv_config()})
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, sp.ready["kv_events"]["replay_endpoint"]],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None
        assert flooder.stdout.readline() == "flooding\n"
        time.sleep(1.0)  # (the requests queue up in the sidecar)
        late: list[str] = []
        for _ in range(5):
            t0 = time.monotonic()
            try:
                with PoolClient(sp.socket_path, timeout=CONNECTOR_DEADLINE_S) as c:
                    c.lookup(fresh_keys(1))
            except KVPoolError as e:
                late.append("{}: {} after {:.2f} s".format(type(e).__name__, e, time.monotonic() - t0))
            time.sleep(0.2)
        assert flooder.poll() is None, "the flood lasted through the lookups"
    finally:
        flooder.kill()
        flooder.wait()
    assert late == []
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        counts = c.stats()["counters"]
    assert counts["kvevents_replays"] > 1000  # the flood reached the sidecar
