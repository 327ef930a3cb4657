"""What preflight runs ON each node, over SSH, before any Ray or kit exists there: the node's facts as JSON.

Shipped as source (`python3 -c ...`), so it is self-contained: standard library only, Python 3.6+
(the Python Ansible already needs on every node), no kit import. Prints one JSON object:

  {"hostname", "addresses": {iface: [IPv4]}, "address_source", "listeners": {port: ["comm[pid]", ...]},
   "shm": {"bytes"} | {"error"}, "gpu": {"count", "driver", "names"} | {"error"}}

Listeners come from /proc/net/tcp{,6} (every LISTEN socket of the node's network namespace, no `ss`
needed); their processes from /proc/<pid>/fd, which only root sees for processes of other users.
"""

import json
import os
import socket
import struct
import subprocess
import sys

LISTEN = "0A"


def addresses():
    try:
        out = subprocess.check_output(["ip", "-j", "-4", "addr", "show"], stderr=subprocess.DEVNULL, timeout=10)
        found = {}
        for link in json.loads(out.decode() or "[]"):
            ips = [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet" and a.get("local")]
            if ips and link.get("ifname"):
                found.setdefault(link["ifname"], []).extend(ips)
        return found, "ip -j addr"
    except Exception:
        pass
    import fcntl

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in sorted(os.listdir("/sys/class/net")):
            try:  # SIOCGIFADDR: the interface's primary IPv4 address (no iproute2 on the node)
                reply = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = [socket.inet_ntoa(reply[20:24])]
    return found, "ioctl (no iproute2)"


def listening_inodes():
    """{port: [socket inode]} of every TCP socket in LISTEN state."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == LISTEN:
                        port = int(parts[1].rsplit(":", 1)[1], 16)
                        out.setdefault(port, []).append(parts[9])
        except (OSError, StopIteration):
            continue
    return out


def holders(inodes):
    """{inode: "comm[pid]"} for the sockets whose process this user can see."""
    wanted = {"socket:[%s]" % i: i for i in inodes}
    found = {}
    if not wanted:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = "/proc/%s/fd" % pid
        try:
            links = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in links:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target in wanted:
                try:
                    with open("/proc/%s/comm" % pid) as f:
                        comm = f.read().strip()
                except OSError:
                    comm = "?"
                found[wanted[target]] = "%s[%s]" % (comm, pid)
    return found


def listeners(ports):
    """{port: [holder]} for the ports asked about (a range is [lo, hi]) that something listens on."""
    by_port = listening_inodes()
    asked = {}
    for item in ports:
        lo, hi = (item, item) if isinstance(item, int) else item
        for port in by_port:
            if lo <= port <= hi:
                asked[port] = by_port[port]
    names = holders([i for inodes in asked.values() for i in inodes])
    return {str(port): sorted({names.get(i, "?") for i in inodes}) for port, inodes in asked.items()}


def shm():
    try:
        st = os.statvfs("/dev/shm")
    except OSError as err:
        return {"bytes": None, "error": err.strerror or str(err)}
    return {"bytes": st.f_frsize * st.f_blocks}


def gpu():
    try:
        p = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = p.communicate(timeout=15)
    except OSError:
        return {"count": 0, "error": "nvidia-smi not found"}
    except subprocess.TimeoutExpired:
        p.kill()
        return {"count": 0, "error": "nvidia-smi did not answer within 15 s"}
    if p.returncode != 0:
        return {"count": 0, "error": (err or out).decode(errors="replace").strip()[:300] or "exit %d" % p.returncode}
    rows = [r.split(",") for r in out.decode().splitlines() if r.strip()]
    return {
        "count": len(rows),
        "names": sorted({r[0].strip() for r in rows}),
        "driver": rows[0][1].strip() if rows and len(rows[0]) > 1 else None,
    }


def main(argv):
    ask = json.loads(argv[1]) if len(argv) > 1 else {}
    found, source = addresses()
    print(
        json.dumps(
            {
                "hostname": socket.gethostname(),
                "addresses": found,
                "address_source": source,
                "listeners": listeners(ask.get("ports", [])),
                "shm": shm(),
                "gpu": gpu() if ask.get("gpu") else None,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv)
