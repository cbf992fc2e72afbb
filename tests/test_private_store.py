"""[private-store] in odcfsdp/launch/processes.py: the launcher's store listens on loopback only, its ranks' keys are out of
reach of other clients, and the watchdog signals only its rank's siblings, whatever pid a store names (issue 32)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from odcfsdp.launch import spawn


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the listening TCP sockets on ``port`` (/proc/net/tcp and tcp6, state 0A)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:  # IPv4, little-endian bytes
                    out.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    out.add("ipv6:" + address)
    return out


def _store_as_seen_by_a_rank() -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    port = int(os.environ["MASTER_PORT"])
    if dist.get_rank() == 0:  # another local client, who knows the port but not the secret
        outsider = dist.TCPStore("127.0.0.1", port, is_master=False)
        outsider.set("forged", "1")
        outsider.set("odcfsdp/meshes", "999")
    dist.barrier()
    store = _get_default_store()
    store.set(f"mine/{dist.get_rank()}", "1")
    dist.barrier()
    return {"listening": _listening_addresses(port), "sees_forged": store.check(["forged"]),
            "meshes_counter": store.add("odcfsdp/meshes", 0), "sees_peer": store.check([f"mine/{1 - dist.get_rank()}"])}


def test_the_store_listens_on_loopback_and_other_clients_cannot_touch_the_ranks_keys():
    """Given only a host name, TCPStore's server listens on every interface (``*:<port>``, issue 32); spawn's
    listens on 127.0.0.1 alone, and keys set by a client without the per-call secret are not the ranks' keys."""
    for seen in spawn(_store_as_seen_by_a_rank, 2, timeout=120):
        assert seen["listening"] == {"127.0.0.1"}, seen
        assert not seen["sees_forged"] and seen["meshes_counter"] == 0, seen
        assert seen["sees_peer"], seen  # the ranks' own keys do work


SIBLINGS = textwrap.dedent("""
    import subprocess, sys, time, signal, os
    sibling = subprocess.Popen(["sleep", "60"])
    os.kill(sibling.pid, signal.SIGSTOP)
    time.sleep(0.2)
    check = "from odcfsdp.sharding.placement.watchdog import stopped_sibling; import sys; print(stopped_sibling(int(sys.argv[1])))"
    for pid in (sibling.pid, int(sys.argv[1])):  # a stopped sibling; a stopped process of another parent
        print(subprocess.run([sys.executable, "-c", check, str(pid)], capture_output=True, text=True).stdout.strip())
    sibling.kill()
""")


def test_the_watchdog_signals_only_stopped_siblings(tmp_path):
    """A process started by the rank's own parent and stopped may be killed; a stopped process of any other parent
    (a pid written into the store by someone else) may not."""
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stranger.pid, signal.SIGSTOP)
        time.sleep(0.2)
        out = subprocess.run([sys.executable, "-c", SIBLINGS, str(stranger.pid)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
        assert stranger.poll() is None  # untouched
    finally:
        stranger.kill()
        stranger.wait()
    from odcfsdp.sharding.placement.watchdog import stopped_sibling

    assert not stopped_sibling(os.getpid()) and not stopped_sibling(1)


def _nic() -> str | None:
    """A network interface other than loopback that has an IPv4 address (eth0 on most hosts), or None."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                return name
            except OSError:
                continue
    return None


def _own_listening_addresses() -> set[str]:
    """The local addresses of every TCP socket this process listens on (its fds' inodes in /proc/net/tcp{,6})."""
    import torch.distributed as dist

    dist.barrier()  # gloo's pairs are connected: every socket it will listen on is open
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            address = cols[1].split(":")[0]
            if cols[3] == "0A" and cols[9] in inodes:
                out.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(address) == 8
                        else "ipv6:" + address)
    return out


def test_the_ranks_own_sockets_listen_on_loopback_only(monkeypatch):
    """gloo (and NCCL's bootstrap) listen on the interface the host name resolves to: a cloud host's NIC, for the
    whole run. Asked for the NIC here (GLOO_SOCKET_IFNAME, where the host has one), spawn's ranks still listen on
    loopback alone ([private-store] 4)."""
    nic = _nic()
    if nic:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", nic)
    for seen in spawn(_own_listening_addresses, 2, timeout=120):
        assert seen and seen <= {"127.0.0.1", "ipv6:0000000000000000FFFF00000100007F",
                                 "ipv6:00000000000000000000000001000000"}, seen
