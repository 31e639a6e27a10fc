"""`up`'s launcher for its roles: one process imports the roles' code once and forks each
role from itself, instead of each of them importing it all again. It first imports what the
roles that run no model need (the command line, the exporter, the archiver, the tracker:
~0.3 CPU s a process) and forks those; at the first request for a role that runs a model
it imports torch, transformers, the model's class and the model roles' code (~3 CPU s:
torch, and transformers' model code with ``torch._dynamo``, ``torch.distributed`` and sympy
under it), then forks the trainer, the evaluator and each producer. The exporter and the
archiver never hold torch.

Every forked role is still `up`'s own child, as if `up` had started it: `up` marks itself a
child subreaper (``PR_SET_CHILD_SUBREAPER``) and the server forks twice, so the role is
orphaned at once and the kernel hands it to `up`, which waits for it, signals it and reads
its exit code (:class:`Forked`, the part of :class:`subprocess.Popen` that
:class:`streamer.lifecycle.Child` uses). The role then does what a started one does: a
session of its own, SIGTERM when `up` dies (``PR_SET_PDEATHSIG``, asked once `up` is its
parent), stdout and stderr appended to its log, and ``streamer.__main__`` with its argv. It
also shows as one: its process name (``/proc/PID/comm``) is its role, and its command line
(``/proc/PID/cmdline``, what ``ps`` and ``pgrep -f`` read) is the one `up` would have run,
written over the server's own, which `up` pads to the longest of them.

The server preloads, it never runs a model or a torch operation itself (a fork after torch
has started its thread pools is unsafe). It imports with the cyclic garbage collector off and
then freezes what it imported (``gc.freeze``), as Python's docs advise for a fork without
exec: the collector's passes over the ~400,000 objects torch and transformers create cost
~1 CPU second during the imports, and ~0.2 s each later full collection in every role, which
also writes to every page of them and so copies the shared heap. A role turns the collector
back on once its command is imported (:func:`streamer.cli.main`); it then scans only the
objects made after the fork. It exits when `up` closes its request pipe, once the
roles are started. Where any of this is not available (not Linux, the server fails to
start or to answer), `up` starts each role the usual way: a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from streamer.lifecycle import child_preexec, prctl

log = logging.getLogger(__name__)

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
READY_TIMEOUT = 120.0  # seconds for the server's imports; past it the roles start the usual way
LIGHT = ("streamer.cli", "consumers.exporter", "consumers.archive", "consumers.tracker")
MODELS = ("producers.producer", "producers.evaluator", "consumers.trainer")


class Forked:
    """A role forked by the server and handed to this process: what :class:`Child` asks of a
    :class:`subprocess.Popen` (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``)."""

    def __init__(self, pid: int, argv: list[str]):
        self.pid, self.args, self.returncode = pid, argv, None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # never handed to us: it exited 1 before running
                    pid, status = self.pid, 1 << 8
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            fd = None
        try:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                if fd is not None:
                    select.select([fd], [], [], left)  # readable once the process has exited
                else:
                    time.sleep(min(0.05, left) if left is not None else 0.05)
        finally:
            if fd is not None:
                os.close(fd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class ForkServer:
    """`up`'s side: the server process and the pipes to it."""

    def __init__(
        self, proc: subprocess.Popen, requests: int, replies, stop: threading.Event, models: tuple[str, ...]
    ):
        self.proc, self._requests, self._replies, self._stop = proc, requests, replies, stop
        self.models = models  # the roles that run a model (a name, or its prefix before a dash)
        self.broken = False
        self._unanswered: list[str] | None = None  # a request left when a stop came

    @classmethod
    def start(
        cls,
        env: dict[str, str],
        log_path: Path,
        model: str,
        stop: threading.Event,
        room: int,
        *,
        models: tuple[str, ...] = (),
    ) -> ForkServer | None:
        """Start the server (it preloads ``model``'s class before the first of the roles
        ``models``) with ``room`` bytes of command line for its roles'; None where roles
        cannot be forked."""
        if not hasattr(os, "fork") or not prctl(PR_SET_CHILD_SUBREAPER, 1):
            return None
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "streamer.cli.forkserver", str(req_r), str(rep_w), model, "-" * room]
        try:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    pass_fds=(req_r, rep_w),
                    start_new_session=True,
                    preexec_fn=child_preexec(os.getpid()),
                )
        except OSError as e:
            log.warning("the role launcher did not start (%s); starting roles the usual way", e)
            os.close(req_w)
            os.close(rep_r)
            return None
        finally:
            os.close(req_r)
            os.close(rep_w)
        return cls(proc, req_w, os.fdopen(rep_r, "rb"), stop, models)

    def spawn(self, name: str, argv: list[str], log_path: Path) -> Forked | None:
        """Fork the role ``argv`` (``python -m streamer ...``) as ``name``; None if the server
        cannot (the caller starts it the usual way) or a stop was asked for meanwhile."""
        if self.broken:
            return None
        model = name.split("-")[0] in self.models
        request = {"name": name, "argv": argv, "log": str(log_path), "model": model}
        try:
            os.write(self._requests, json.dumps(request).encode() + b"\n")
            reply = self._reply(self._stop)
        except (OSError, ValueError) as e:
            reply = {"error": str(e)}
        if reply is None:
            self._unanswered = argv
            return None
        if "pid" not in reply:
            self.broken = True
            self.proc.kill()  # so that it cannot fork this role late, beside the one started instead
            log.warning("the role launcher failed (%s); starting roles the usual way", reply.get("error"))
            return None
        return Forked(int(reply["pid"]), argv)

    def _reply(self, stop: threading.Event | None = None, timeout: float = READY_TIMEOUT) -> dict | None:
        deadline = time.monotonic() + timeout
        while stop is None or not stop.is_set():
            if select.select([self._replies], [], [], 0.2)[0]:
                line = self._replies.readline()
                return json.loads(line) if line else {"error": f"it exited with code {self.proc.wait()}"}
            if time.monotonic() > deadline:
                return {"error": f"no answer in {timeout:.0f}s"}
        return None

    def close(self) -> None:
        """Let the server go (it exits at the end of its requests); stop a role it forked for
        a request a stop left unanswered."""
        os.close(self._requests)
        if self._unanswered is not None and "pid" in (reply := self._reply(timeout=10.0) or {}):
            late = Forked(int(reply["pid"]), self._unanswered)
            late.send_signal(signal.SIGTERM)
            try:
                late.wait(30)
            except subprocess.TimeoutExpired:
                late.send_signal(signal.SIGKILL)
                late.wait()
        self._replies.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- the server process


def _import(modules: tuple[str, ...], model: str | None = None) -> None:
    """``modules`` (and ``model``'s class); a failure is only logged: a role that needs what
    failed reports it itself, in its own log."""
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
        if model is not None:
            _import_model_class(model)
    except Exception as e:
        print(f"streamer forkserver: preload incomplete: {e!r}", file=sys.stderr, flush=True)


def _preload_models(model: str) -> None:
    """The model roles' code and ``model``'s class, once; exits (1) where an import
    initialised CUDA, which a forked child could not use (`up` then starts the rest itself)."""
    _import(MODELS, model)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("streamer forkserver: CUDA was initialised by an import; not forking", file=sys.stderr)
        raise SystemExit(1)
    gc.freeze()  # the roles' collections leave the preloaded heap (and its shared pages) alone


def _import_model_class(model: str) -> None:
    from streamer import demo

    if model == demo.DEMO:
        from transformers import Qwen2ForCausalLM  # noqa: F401

        return
    config = Path(model) / "config.json"
    if config.is_file():  # a local model: its class (a hub name's would need the network)
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(json.loads(config.read_text()).get("model_type"))
        if name:
            getattr(transformers, name)


def _serve(requests, replies: int, model: str) -> dict | None:
    """Fork a role for each request; the request, in the role's process; None at EOF."""
    loaded = False  # the model roles' code
    for line in requests:
        request = json.loads(line)
        if request.get("model") and not loaded:
            _preload_models(model)
            loaded = True
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            got, sent = os.pipe()
            middle = os.fork()
        except OSError as e:
            os.write(replies, json.dumps({"error": f"fork: {e}"}).encode() + b"\n")
            continue
        if middle == 0:  # forks the role and exits at once, so that the role is `up`'s
            os.close(got)
            try:
                role = os.fork()
            except OSError:
                os._exit(1)
            if role == 0:
                os.close(sent)
                return request
            os.write(sent, str(role).encode())
            os._exit(0)
        os.close(sent)
        with os.fdopen(got, "rb") as f:
            pid = f.read()
        os.waitpid(middle, 0)
        reply = {"pid": int(pid)} if pid else {"error": "the fork of the role failed"}
        os.write(replies, json.dumps(reply).encode() + b"\n")
    return None


def _become(request: dict, up: int) -> int:
    """In the forked role: be what `up` would have started, then run it."""
    os.setsid()
    deadline = time.monotonic() + 10.0
    while os.getppid() != up:  # the middle process is exiting; then the kernel hands us to `up`
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.001)
    child_preexec(up)()  # SIGTERM when `up` dies; exits 1 if it died before that took effect
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    prctl(PR_SET_NAME, ctypes.c_char_p(request["name"].encode()[:15]))
    if "numpy.random" in sys.modules:  # `random` reseeds itself after a fork; numpy's does not
        sys.modules["numpy.random"].seed()
    _show_as(request["argv"])
    sys.argv = ["streamer", *request["argv"][3:]]
    from streamer.__main__ import run

    return run()


def _show_as(argv: list[str]) -> None:
    """Write ``argv`` over this process's command line (the bytes the kernel serves as
    /proc/PID/cmdline), NUL-padded to its length; left as it is where it does not fit or the
    kernel refuses."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end
        text = b"\0".join(a.encode() for a in argv) + b"\0"
        if len(text) > end - start:
            return
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(text.ljust(end - start, b"\0"))
    except (OSError, ValueError, IndexError):
        pass


def main(argv: list[str]) -> int:
    req, rep, model = int(argv[0]), int(argv[1]), argv[2]
    up = os.getppid()
    from streamer import lifecycle

    lifecycle.take_finish_signal()  # a role's SIGUSR1 is kept from its first instruction
    gc.disable()  # on again in each role, once its command is imported (streamer.cli.main)
    _import(LIGHT)
    gc.freeze()
    requests = os.fdopen(req, "r")
    request = _serve(requests, rep, model)
    requests.close()
    os.close(rep)
    return 0 if request is None else _become(request, up)


if __name__ == "__main__":
    import warnings

    # torch's import leaves a native thread behind: harmless to a fork before any torch op
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    sys.exit(main(sys.argv[1:]))
