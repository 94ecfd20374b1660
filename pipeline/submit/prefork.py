"""A pre-imported parent for local jobs: torch and megatron.core imported once per run, each rank forked.

Every local job pays the same start-up before its first step: a fresh interpreter importing torch,
megatron.core and the engine (~3.5 s here), then tearing all of it down at exit (~1 s). With
``cluster.prefork`` (default, local executor only) the command starts one **server** that imports all of
that once; submitit's local controller then runs a small **relay** instead of ``python`` for each task:

    controller ──► relay (python -m pipeline.submit.prefork relay SOCK -u -m submitit.core._submit FOLDER)
                     │ unix socket: argv, environment, cwd, stdin/stdout/stderr descriptors
    server ────────► fork ──► rank: same environment, cwd, descriptors; runs submitit.core._submit

The rank runs the job's entry code unchanged (``submitit.core._submit`` -> ``pipeline.submit.launch.run_stage``).
The relay stands in for it towards the controller: it forwards the signals it gets (SIGTERM, SIGINT,
SIGUSR1/2, SIGQUIT, SIGHUP, SIGCONT) and exits with the rank's exit status. Nothing outlives its owner:

- the rank runs in its own process group (terminal signals reach it once, through the relay) and is
  SIGKILLed by the kernel when the server dies (``PR_SET_PDEATHSIG``);
- the server SIGKILLs a rank whose relay has gone (killed, or the controller's kill);
- the server stops listening when the command that started it ends (its stdin closes) and exits once its
  ranks have ended.

The relay falls back to ``exec python`` (the ordinary local job) when there is no server, when the server
dies before answering, or when it refuses: another working directory or interpreter, or a variable that
matters at import time (``IMPORT_ENV_PREFIXES``) with another value than the server imported under.
``ps -o pid,comm`` names a forked rank ``job<controller pid>.r<rank>``.

No torch import at this module's level (the relay imports only the standard library).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from pipeline.slurm.job_env import RELAY_ENV

IMPORT_ENV_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "LD_", "CUDA_")
"""Variables read while torch/megatron import (or by the interpreter at start): a request whose values of
these differ from the server's is refused and runs as an ordinary process."""

PRELOAD = (
    "torch._dynamo",  # torch.optim's first optimizer imports it (~0.7 s)
    "torch.utils.tensorboard",  # monitor.tensorboard (after megatron.core, which imports it hidden)
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.pipeline_parallel",
)
"""External modules the server imports after the project's (``_import_project``, ``declared_modules``) and
megatron.core, the way a job imports them; one that fails (an optional package) is skipped."""

RELAYED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGCONT,
)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
POLL_S = 0.05


# ---------------------------------------------------------------------------- the command's side


@dataclass
class Server:
    """A running server, as the command that started it holds it (``start``; ``close`` when done)."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    log: Path

    @property
    def python(self) -> str:
        """What submitit's LocalExecutor runs instead of ``python`` (its ``python`` argument)."""
        return relay_command(self.socket_path)

    def release(self) -> None:
        """Stop accepting ranks; the server ends by itself once the ranks it forked have ended."""
        with contextlib.suppress(OSError):
            if self.process.stdin:
                self.process.stdin.close()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting ranks; wait (up to ``wait_s``) for the server to end, then end it."""
        with contextlib.suppress(OSError):
            if self.process.stdin:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
            self.socket_path.parent.rmdir()


@dataclass
class Attached:
    """A server another process started and owns (``cluster.prefork_socket``): used, never closed, here."""

    socket_path: Path

    @property
    def python(self) -> str:
        return relay_command(self.socket_path)

    def close(self) -> None:
        """Its owner ends it."""


def relay_command(socket_path: Path) -> str:
    """The relay's command line for the server at ``socket_path`` (a relay without a server runs plainly)."""
    return " ".join(
        shlex.quote(a) for a in (sys.executable, "-m", "pipeline.submit.prefork", "relay", str(socket_path))
    )


def start(log: Path) -> Server:
    """Start a server (it imports in the background; relays that connect meanwhile wait for it)."""
    sock = Path(tempfile.mkdtemp(prefix="pipeline-prefork-")) / "sock"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "pipeline.submit.prefork", "serve", str(sock)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=task_env(),
        )
    deadline = time.monotonic() + 30.0
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the socket is bound first thing, before the imports
    return Server(proc, sock, log)


def task_env() -> dict[str, str]:
    """The environment submitit's local controller gives a CPU task (no visible GPU): the server imports in it."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES)}


# ---------------------------------------------------------------------------- the relay


def relay(sock_path: str, argv: list[str]) -> NoReturn:
    """Run ``python *argv`` as a rank forked by the server at ``sock_path``, or as a plain process."""
    conn = _connect(sock_path)
    if conn is None:
        _exec_plain(argv)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "python": sys.executable}
    lines = conn.makefile("rb")
    try:
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = json.loads(lines.readline() or b"{}")
    except (OSError, ValueError):
        reply = {}
    if "pid" not in reply:
        conn.close()
        _exec_plain(argv)  # the server died or refused (its log says why)
    pid = int(reply["pid"])
    for sig in RELAYED_SIGNALS:
        signal.signal(sig, lambda s, _f: _forward(pid, s))
    try:
        end = json.loads(lines.readline() or b"{}")
    except (OSError, ValueError):
        end = {}
    status = int(end.get("status", 1))  # no status: the server died, and with it the rank
    if status < 0:  # the rank was killed by a signal: so is its stand-in
        if -status in {int(s) for s in RELAYED_SIGNALS}:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def _connect(sock_path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
    except OSError:
        conn.close()
        return None
    return conn


def _read_line(conn: socket.socket, buf: bytes = b"") -> dict[str, Any] | None:
    while not buf.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return dict(json.loads(buf))


def _forward(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _exec_plain(argv: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *argv])


# ---------------------------------------------------------------------------- the server


def serve(sock_path: str) -> None:
    """Bind, import everything a job imports, then fork one rank per relay until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the ranks through their relays
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    t0, start_env = time.perf_counter(), import_env(dict(os.environ))  # before the imports set any
    preload()
    print(f"[prefork] server {os.getpid()}: imports done in {time.perf_counter() - t0:.2f} s", flush=True)
    ranks: dict[int, socket.socket] = {}  # rank pid -> its relay's connection
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    accepting = True
    while accepting or ranks:
        for key, _ in sel.select(timeout=POLL_S):
            if key.data == "accept":
                _accept(listener, ranks, sel, start_env)
            elif key.data == "stdin" and not os.read(sys.stdin.fileno(), 4096):
                accepting = False  # the command ended: no new ranks
                sel.unregister(sys.stdin)
                sel.unregister(listener)
                listener.close()
            elif isinstance(key.data, int) and not _peek_alive(key.fileobj):  # type: ignore[arg-type]
                _forward(key.data, signal.SIGKILL)  # the relay is gone: so goes its rank
                sel.unregister(key.fileobj)
        _reap(ranks, sel)


def preload() -> None:
    """Import what a job imports, the way it does (distributed.prepare_imports first)."""
    from engine.runtime import distributed

    distributed.prepare_imports()
    try:
        _import_project()
    except Exception as e:  # the rank imports it itself (and reports the error there)
        print(f"[prefork] project modules not all preloaded: {type(e).__name__}: {e}", flush=True)
    _import_by_name(declared_modules())
    _import_by_name(PRELOAD)


def declared_modules() -> tuple[str, ...]:
    """The project modules a job imports by a declared name, read from the declarations (no torch): every
    stage's module (pipeline.schema.graph, ``stages.entry``) and every RL algorithm's engine module
    (pipeline.schema.rl, ``engine.rl.registry.get``); a new stage or algorithm is preloaded with no edit here."""
    import stages
    from pipeline.schema import graph, rl

    return (*(stages.module(s) for s in graph.STAGES), *(a.engine_module for a in rl.REGISTRY))


def _import_by_name(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional package or a broken module: the rank imports it itself
            print(f"[prefork] not preloaded: {name}: {type(e).__name__}: {e}", flush=True)


def _import_project() -> None:
    """The project modules jobs import besides the declared ones (plain imports, so the import graph shows them)."""
    import submitit.core.submission  # noqa: F401

    import engine.checkpoint.manager  # noqa: F401
    import engine.models.generate  # noqa: F401
    import engine.rl.registry  # noqa: F401
    import engine.run  # noqa: F401
    import engine.train.steps  # noqa: F401
    import pipeline.submit.launch  # noqa: F401


def _accept(
    listener: socket.socket,
    ranks: dict[int, socket.socket],
    sel: selectors.BaseSelector,
    start_env: dict[str, str],
) -> None:
    conn, _ = listener.accept()
    conn.settimeout(10.0)  # a relay sends its request at once
    try:
        first, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)  # the descriptors come with the first bytes
        request = _read_line(conn, first) if first else None
    except (OSError, ValueError):
        conn.close()
        return
    conn.settimeout(None)
    reason = _refusal(request, fds, start_env)
    if reason:
        print(f"[prefork] refused: {reason}", flush=True)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": reason}).encode() + b"\n")
        conn.close()
        return
    assert request is not None
    relay_pid = socket_peer_pid(conn)
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        sel.close()
        for other in (listener, conn, *ranks.values()):
            other.close()
        _child(request, fds, relay_pid, server)
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    sel.register(conn, selectors.EVENT_READ, pid)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _refusal(request: dict[str, Any] | None, fds: list[int], start_env: dict[str, str]) -> str | None:
    if not request or len(fds) != 3:
        return "malformed request"
    if request["python"] != sys.executable:
        return f"interpreter {request['python']} (server: {sys.executable})"
    if request["cwd"] != os.getcwd():
        return f"working directory {request['cwd']} (server: {os.getcwd()})"
    theirs, ours = import_env(request["env"]), start_env
    if theirs != ours:
        keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        return f"environment differs in {', '.join(keys)}"
    if threading.active_count() != 1:  # native pools (OpenBLAS, OpenMP) handle fork themselves
        return f"the server runs {threading.active_count()} Python threads (fork would not be safe)"
    return None


def socket_peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[:4], sys.byteorder)


def _peek_alive(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _reap(ranks: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while ranks:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None:
            continue
        status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()


def _child(request: dict[str, Any], fds: list[int], relay_pid: int, server: int) -> None:
    """In the forked rank: become the process the relay would have exec'd, run the job, exit."""
    code = 1
    try:
        _become(request, fds, relay_pid, server)
        code = _run_module(request["argv"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _become(request: dict[str, Any], fds: list[int], relay_pid: int, server: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:
        os._exit(1)  # the server died between the fork and the prctl
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[RELAY_ENV] = str(relay_pid)
    env = request["env"]
    name = f"job{env.get('SUBMITIT_LOCAL_JOB_ID', '')}.r{env.get('SUBMITIT_LOCAL_GLOBALID', '')}"
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    _reseed()


def _reseed() -> None:
    """Seed from the OS the generators a fresh interpreter seeds from it (``random`` reseeds itself at fork):
    forked ranks must not share numpy's or torch's default stream."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.random.seed()


def _run_module(argv: list[str]) -> int:
    """``python -u -m MODULE ARGS``: run it as __main__, then exit as the interpreter would (without the
    teardown of every module, the slow part of a torch process's exit)."""
    import atexit
    import runpy

    args = [a for a in argv if a != "-u"]
    if len(args) < 2 or args[0] != "-m":
        print(f"[prefork] cannot run {argv}: only 'python [-u] -m MODULE ...'", file=sys.stderr)
        return 2
    code = 0
    sys.argv = [args[1], *args[2:]]
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # as Py_Finalize: non-daemon threads first
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def _main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1])
        sys.stdout.flush()
        os._exit(0)  # nothing left to clean up: skip tearing down torch (the command waits for this exit)
    elif len(argv) >= 2 and argv[0] == "relay":
        relay(argv[1], argv[2:])
    else:
        print(
            "usage: python -m pipeline.submit.prefork serve SOCK | relay SOCK PYTHON-ARGS...", file=sys.stderr
        )
        sys.exit(2)


if __name__ == "__main__":
    _main(sys.argv[1:])
