"""The supervisor's bookkeeping without processes: command lines rebuilt for a restart, and a
run dir read back (the cluster tests run it for real: test_supervise.py)."""
from __future__ import annotations

import json
import os

from pdtb.local_cluster.supervise import Supervisor, node_ready, with_flag

DEAD_PID = 2 ** 22 + 7  # above pid_max's default: no such process


def test_with_flag_replaces_every_occurrence():
    argv = ["pdtb", "decode", "--node-id", "decode-1", "--kv-pages", "9", "--node-id=x"]
    assert with_flag(argv, "--node-id", "decode-1~2") == ["pdtb", "decode", "--kv-pages", "9", "--node-id", "decode-1~2"]
    assert with_flag(["r", "--node", "a", "--node", "b", "--port", "0"], "--node", None) == ["r", "--port", "0"]


def write_member(run_dir, name: str, argv: list[str], pid: int, ready: dict | None = None) -> None:
    (run_dir / f"{name}.argv").write_bytes("".join(a + "\0" for a in argv).encode())
    (run_dir / f"{name}.pid").write_text(f"{pid}\n")
    (run_dir / f"{name}.log").write_text("warming up\n" + (f"NODE READY {json.dumps(ready)}\n" if ready else ""))


def test_a_restarted_router_is_given_the_live_nodes_and_its_port(tmp_path):
    (tmp_path / "url").write_text("http://[::1]:8123\n")
    write_member(tmp_path, "router-0", ["pdtb", "router", "--host", "::1", "--port", "0", "--node", "prefill=tcp://a",
                                        "--node", "decode=tcp://b", "--api-key", "k"], DEAD_PID)
    write_member(tmp_path, "prefill-0", ["pdtb", "prefill", "--node-id", "prefill-0"], os.getpid(),
                 {"ctrl": "tcp://[::1]:1"})
    write_member(tmp_path, "decode-0", ["pdtb", "decode", "--node-id", "decode-0"], DEAD_PID, {"ctrl": "tcp://[::1]:2"})
    sup = Supervisor(tmp_path)
    assert sorted(sup.members) == ["decode-0", "prefill-0", "router-0"] and sup.api_key == "k"
    assert sup.members["prefill-0"].ctrl == "tcp://[::1]:1"
    argv, log = sup.command(sup.members["router-0"])
    # the dead decode node is left out; the port is the one it served on, not 0
    assert argv == ["pdtb", "router", "--host", "::1", "--api-key", "k", "--port", "8123", "--node", "prefill=tcp://[::1]:1"]
    sup.members["decode-0"].restarts = 2
    argv, log = sup.command(sup.members["decode-0"])
    assert argv[-2:] == ["--node-id", "decode-0~2"] and log.name == "decode-0~2.log"


def test_node_ready_takes_the_last_ready_line(tmp_path):
    log = tmp_path / "n.log"
    assert node_ready(log) is None
    log.write_text('NODE READY {"ctrl": "tcp://x:1"}\nboom\nNODE READY {"ctrl": "tcp://x:2"}\n')
    assert node_ready(log) == {"ctrl": "tcp://x:2"}


def test_a_replacement_is_added_to_every_router_at_its_own_address(tmp_path, monkeypatch):
    """With several routers behind one port (--peer-dir in their command lines) a replacement
    node is added to each at its private admin address, read anew at each try (a restarted
    router has a new one); a lone router is reached at the url file's address."""
    import pdtb.local_cluster.supervise as supervise

    (tmp_path / "url").write_text("http://127.0.0.1:8000\n")
    for i in range(2):
        write_member(tmp_path, f"router-{i}", ["pdtb", "router", "--reuse-port", "--peer-dir", str(tmp_path),
                                               "--metrics-dir", str(tmp_path / "m")], DEAD_PID)
        (tmp_path / f"router-{i}.admin").write_text(f"http://127.0.0.1:{9000 + i}\n")
    write_member(tmp_path, "decode-0", ["pdtb", "decode", "--node-id", "decode-0"], DEAD_PID, {"ctrl": "tcp://x:2"})
    asked = []
    monkeypatch.setattr(supervise, "add_replacement",
                        lambda url, role, addr, old, key: asked.append((url(), addr, old)))
    sup = Supervisor(tmp_path)
    sup.members["decode-0"].ctrl = "tcp://x:3"
    (tmp_path / "router-1.admin").write_text("http://127.0.0.1:9100\n")  # router-1 restarted
    sup.add_to_router(sup.members["decode-0"], "tcp://x:2")
    assert asked == [("http://127.0.0.1:9000", "tcp://x:3", "tcp://x:2"),
                     ("http://127.0.0.1:9100", "tcp://x:3", "tcp://x:2")]
    lone = Supervisor.__new__(Supervisor)
    lone.run_dir = tmp_path
    assert lone.admin_url(supervise.Member("router-0", "router", ["pdtb", "router"]))() == "http://127.0.0.1:8000"
