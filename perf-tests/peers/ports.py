"""A free port on 127.0.0.1 for a server the peers' benchmarks start, held race-free."""

import socket


def reserve_port():
    """A port on 127.0.0.1 and the socket that holds it: bound with SO_REUSEADDR, never
    listening. While it is open the kernel hands the port to no other bind to port 0 and no
    outgoing connection, yet a server that binds it explicitly with SO_REUSEADDR (as torch's
    TCPStore and iperf3 do) can listen on it. (Binding port 0 and closing the socket to find a
    free port let another process take the port before the server bound it.) Close it once
    the server is done."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]
