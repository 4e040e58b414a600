"""Data-loader workers drop the sockets they inherit (workers.py)."""

from __future__ import annotations

from mlm import run_python


def test_data_loader_workers_drop_inherited_tcp_sockets() -> None:
    proc = run_python("""
        import os, socket
        from megatron_deadpool.megatron_lm.workers import close_inherited_tcp_sockets
        tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
        unix_a, unix_b = socket.socketpair()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            n = close_inherited_tcp_sockets()
            def is_open(fd):
                try:
                    os.fstat(fd)
                    return 1
                except OSError:
                    return 0
            os.write(w, f"{n} {is_open(tcp.fileno())} {is_open(unix_a.fileno())}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(r, 100).decode(), tcp.fileno() >= 0)
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    closed, tcp_open, unix_open, parent_keeps = proc.stdout.split()
    assert int(closed) >= 1 and tcp_open == "0" and unix_open == "1" and parent_keeps == "True"
