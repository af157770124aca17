#!/usr/bin/env python3
"""tcp_bw.py -- loopback TCP throughput on 127.0.0.1, the machine's socket limit beside
qccl's bus bandwidth. Stdlib only.

    python3 tcp_bw.py [-P 1] [-l 128K,1M] [-t 3] [--tool auto|iperf3|python] [-J out.json]

With iperf3 (Debian's package) when present: `iperf3 -s -1 -B 127.0.0.1` and
`iperf3 -c 127.0.0.1 -P streams -l write_size -t secs -J`, the receiver's bits/s. Otherwise
a sender and a receiver process of its own (sendall / recv_into of write_size blocks) for
each stream. The write size matters a lot on loopback (iperf3's default is 128 KiB; 1 MiB
writes go ~2x faster here), so both are measured by default.
COUNTED: payload bytes received per second, GB = 1e9 B, all streams together.
(iperf3 3.12 runs all streams in one thread: use --tool python for -P 2.)

JSON (-J): [{"what": "tcp_loopback", "streams": 1, "write_bytes": 131072, "secs": 3,
             "tool": "iperf3", "GBps": 2.3}, ...]
"""
import argparse
import json
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import time

from ports import reserve_port


def run_iperf3(streams, secs, blk):
    hold, port = reserve_port()
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        d = {"error": "not run"}
        for _ in range(30):  # retry while the server is not listening yet
            time.sleep(0.1)
            out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P",
                                  str(streams), "-l", str(blk), "-t", str(secs), "-J"], capture_output=True,
                                 text=True, timeout=secs + 30)
            d = json.loads(out.stdout or '{"error": "no output"}')
            if "error" not in d or "unable to connect" not in d["error"]:
                break
        if "error" in d:
            raise RuntimeError(d["error"])
        return d["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
    finally:
        try:
            srv.wait(timeout=5)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        hold.close()


def _recv(port_q, res_q, blk):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    c, _ = ls.accept()
    buf = bytearray(blk)
    mv = memoryview(buf)
    n = 0
    t0 = None
    while True:
        k = c.recv_into(mv)
        if k == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += k
    res_q.put((n, time.perf_counter() - (t0 or time.perf_counter())))


def _send(port, secs, blk):
    s = socket.create_connection(("127.0.0.1", port))
    data = memoryview(bytearray(blk))
    end = time.perf_counter() + secs
    while time.perf_counter() < end:
        s.sendall(data)
    s.close()


def run_python(streams, secs, blk):
    port_q, res_q = mp.Queue(), mp.Queue()
    procs = []
    for _ in range(streams):
        r = mp.Process(target=_recv, args=(port_q, res_q, blk))
        r.start()
        procs.append(r)
    ports = [port_q.get(timeout=10) for _ in range(streams)]
    for p in ports:
        s = mp.Process(target=_send, args=(p, secs, blk))
        s.start()
        procs.append(s)
    res = [res_q.get(timeout=secs + 30) for _ in range(streams)]
    for p in procs:
        p.join(timeout=10)
    return sum(n / t for n, t in res if t > 0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-P", default="1", help="stream counts, comma separated")
    ap.add_argument("-l", default="128K,1M", help="write sizes, comma separated (K/M)")
    ap.add_argument("-t", type=float, default=3.0, help="seconds per measurement")
    ap.add_argument("--tool", choices=("auto", "iperf3", "python"), default="auto")
    ap.add_argument("-J", default=None)
    a = ap.parse_args()
    tool = a.tool
    if tool == "auto":
        tool = "iperf3" if shutil.which("iperf3") else "python"
    print(f"# tcp_bw: loopback 127.0.0.1, tool {tool}, counted = payload bytes received / s,"
          f" GB = 1e9 B")
    out = []
    mul = {"k": 1 << 10, "m": 1 << 20}
    sizes = [int(x[:-1]) * mul[x[-1].lower()] if x[-1].lower() in mul else int(x)
             for x in a.l.split(",") if x.strip()]
    for st in [int(x) for x in a.P.split(",") if x.strip()]:
        for blk in sizes:
            try:
                if tool == "iperf3":
                    gb = run_iperf3(st, int(max(1, round(a.t))), blk)
                else:
                    gb = run_python(st, a.t, blk)
            except Exception as e:
                print(f"# tcp_bw: {st} stream(s), {blk} B writes failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
                continue
            print(f"streams {st}, {blk:>8} B writes: {gb:.2f} GB/s", flush=True)
            out.append({"what": "tcp_loopback", "streams": st, "write_bytes": blk,
                        "secs": a.t, "tool": tool, "GBps": round(gb, 4)})
    if a.J:
        with open(a.J, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
