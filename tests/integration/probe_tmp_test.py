# temporary debug copy (not part of the deliverable)
from tests.integration.test_pool_netns import *  # noqa
import time

def test_probe(net, pool):
    a = pool("a")
    b = pool("b", dram={"size_bytes": "24Mi"})
    keys = fresh_keys(16)
    data = [payload(k, 1 << 20) for k in keys]
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, data, chain=True)
    net.hosts["a"].shape("40mbit")
    t0 = time.monotonic()
    getter = start_transfer(net, b, keys, 16 << 20, timeout=CUT_DEADLINE_S)
    print("cut at", time.monotonic() - t0, net.hosts["b"].rx_bytes())
    net.hosts["b"].link(False, side="bridge")
    got = getter.outcome(CUT_DEADLINE_S)
    print("got", sum(g is not None for g in got), time.monotonic() - t0)
    for h in "ab":
        print(h, subprocess.run([*net.hosts[h].exec_prefix, "ss", "-tni"], capture_output=True, text=True).stdout)
    net.hosts["a"].shape("")
    net.hosts["b"].link(True, side="bridge")
    for i in range(20):
        print(round(time.monotonic() - t0, 2), net.hosts["a"].tcp_queued(PEER_PORT), net.hosts["b"].tcp_queued(PEER_PORT), net.hosts["b"].rx_bytes())
        time.sleep(0.5)
    print(b.log_tail(15)); print(a.log_tail(10))
