"""The agent of a distlib test VM (PID 1 after boot.sh): runs the host's commands, each with a
deadline, and answers with their status and output.

It listens on 10.0.2.15:7000, the guest's side of QEMU's user network; QEMU forwards a port of
the host's loopback there (``hostfwd``), and nothing on the VMs' LAN can reach it. One request
per connection, so the host runs commands side by side on separate connections:

    agent → host   {"hello": NAME}\\n
    host → agent   {"argv": [...], "env": {...}, "timeout": S, "input": "...", "cwd": "/"}\\n
    agent → host   {"rc": N, "out": "...", "err": "...", "seconds": S, "timed_out": false}\\n

A command still running at its timeout is killed with its whole process group (it runs in a
session of its own) and answered with ``timed_out: true`` (after at most KILL_GRACE_S more
seconds: a process blocked in the kernel may not die at once). Python's standard library only: the
image holds nothing else of the project's.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ADDRESS = ("10.0.2.15", 7000)
NAME = socket.gethostname()
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    # distlib from the host's working tree (read-only share); bytecode cached in the guest
    "PYTHONPATH": "/opt/src",
    "PYTHONPYCACHEPREFIX": "/var/cache/distlib-pyc",
    "PYTHONUNBUFFERED": "1",
}
MAX_OUTPUT = 4 << 20
KILL_GRACE_S = 10


def run(request):
    """Run one command; its output goes through files on the guest's own disk, so a process the
    kernel cannot kill (blocked on a dead NFS server) does not keep the answer from the host."""
    env = dict(BASE_ENV)
    env.update(request.get("env") or {})
    timeout = float(request.get("timeout", 60))
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as stdin:
        stdin.write((request.get("input") or "").encode())
        stdin.seek(0)
        proc = subprocess.Popen(request["argv"], env=env, cwd=request.get("cwd") or "/", stdin=stdin,
                                stdout=out, stderr=err, start_new_session=True)
        timed_out = unkillable = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                unkillable = True  # in the kernel, e.g. on a hard NFS mount whose server is down
        answer = {"rc": proc.returncode if not unkillable else -9, "out": _read(out), "err": _read(err),
                  "seconds": time.monotonic() - started, "timed_out": timed_out}
    if unkillable:
        answer["err"] += (f"\nagent: pid {proc.pid} did not die within {KILL_GRACE_S} s of SIGKILL "
                          "(blocked in the kernel)")
    return answer


def _read(f) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - MAX_OUTPUT))
    return f.read().decode("utf-8", "replace")


def serve(conn):
    with conn:
        try:
            conn.sendall(json.dumps({"hello": NAME}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            request = json.loads(data)
            try:
                answer = run(request)
            except OSError as exc:  # the program cannot be started
                answer = {"rc": 127, "out": "", "err": f"agent: {request.get('argv')}: {exc}", "seconds": 0.0,
                          "timed_out": False}
            conn.sendall(json.dumps(answer).encode() + b"\n")
        except (OSError, ValueError) as exc:
            print(f"agent: a request failed: {exc!r}", file=sys.stderr, flush=True)


def main():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(ADDRESS)
    listener.listen(64)
    print(f"distlib-vm: agent of {NAME} listening on {ADDRESS[0]}:{ADDRESS[1]}", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
