"""Malformed configs for every role's CLI: one clear error line naming the key, exit code 2.

For each role: an unknown key, a value of the wrong type, a negative size (in the section
the role reads) and an unusable run name, from the config file; and a negative value from
the role's own command-line flags. tests/test_config.py covers the parser itself.
Nothing here reaches a server: the URL points at a closed port. Server URLs that cannot be
used, or lead nowhere, are one line as well (exit 2 and 1, as for any other bad URL or
unreachable server).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bounds import RUN
from harness import report
from trainer_data import REPO

from streamer.server import free_port

pytestmark = pytest.mark.slow  # every case is a CLI process

CLOSED = "redis://127.0.0.1:1/0"

# role -> (section, wrong-type key and TOML value, negative key and value)
ROLES = {
    "train": ("trainer", ("groups_per_step", '"8"'), ("groups_per_step", "-4")),
    "produce": ("producer", ("group_size", '"x"'), ("group_size", "-1")),
    "eval": ("eval", ("batch_size", "1.5"), ("batch_size", "-2")),
    "metrics": ("metrics", ("port", '"x"'), ("health_interval", "-1.0")),
    "status": ("metrics", ("stall_seconds", "[1]"), ("stall_seconds", "-5.0")),
    "up": ("bus", ("max_unacked", "true"), ("max_unacked", "-16")),
    "smoke": ("bus", ("read_count", '"64"'), ("read_count", "-1")),
}
FLAGS = {  # a flag's error names the config key it overrides, with the bound
    "train": (["--steps", "-1"], "key `trainer.steps`: must be >= 0"),
    "produce": (["--max-groups", "-1"], "key `producer.max_groups`: must be >= 0"),
    "metrics": (["--port", "70000"], "key `metrics.port`: must be <= 65535"),
    "up": (["--steps", "-3"], "key `trainer.steps`: must be >= 0"),
}


def _cases(tmp_path):
    for role, (section, (wkey, wval), (nkey, nval)) in ROLES.items():
        files = {
            "unknown key": (f"[{section}]\nbogus_key = 1\n", f"unknown key `{section}.bogus_key`"),
            "wrong type": (f"[{section}]\n{wkey} = {wval}\n", f"key `{section}.{wkey}`: Expected"),
            "negative size": (f"[{section}]\n{nkey} = {nval}\n", f"key `{section}.{nkey}`: must be"),
            "bad run name": ('[run]\nname = "my run!"\n', "key `run.name`"),
        }
        for kind, (text, expect) in files.items():
            path = tmp_path / f"{role}-{kind.replace(' ', '-')}.toml"
            path.write_text(text)
            yield role, kind, ["--config", str(path)], f"streamer {role}: config error: {path}: ", expect
        if role in FLAGS:
            flags, expect = FLAGS[role]
            yield role, "flag", flags, f"streamer {role}: config error: command line: ", expect


def _not_one_line(proc, *, code: int, prefix: str, expect: str, hidden: str = "") -> str | None:
    """None when ``proc`` exited ``code`` with one line on stderr that starts with ``prefix``
    and holds ``expect`` (and ``hidden`` appears nowhere in its output); else what it did."""
    out, err = proc.communicate(timeout=RUN)
    lines = err.strip().splitlines()
    one = len(lines) == 1 and lines[0].startswith(prefix) and expect in lines[0]
    if proc.returncode == code and one and not (hidden and hidden in out + err):
        return None
    return f"exit {proc.returncode} (want {code}), stderr:\n{err[-1500:]}"


def test_every_role_names_the_key_and_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cases = list(_cases(tmp_path))
    running = [
        (
            case,
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "streamer",
                    case[0],
                    "--redis-url",
                    CLOSED,
                    "--data-dir",
                    str(tmp_path),
                    *case[2],
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for case in cases
    ]
    failures = []
    for (role, kind, _, prefix, expect), proc in running:
        if (wrong := _not_one_line(proc, code=2, prefix=prefix, expect=expect)) is not None:
            failures.append(f"{role} / {kind}: {wrong}")
    report(
        "bad-configs",
        roles=len(ROLES),
        cases=len(cases),
        clear_exit_2=len(cases) - len(failures),
        failed=len(failures),
        crashed=sum("Traceback" in f for f in failures),
    )
    assert not failures, "\n\n".join(failures)


def test_config_errors_found_after_connecting_leave_nothing_behind(redis_url, keys, client, tmp_path):
    """Errors only a role can see (an import path, a dataset file) stop it before it writes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cases = {
        "train": ('[trainer]\nuser_filter = "no_such_module:keep"\n', "`trainer.user_filter`"),
        "produce": ('[producer]\nreward = "no_such_module:score"\n', "reward 'no_such_module:score'"),
        "eval": (f'[eval]\ndataset = "{tmp_path / "absent.jsonl"}"\n', "cannot read dataset"),
    }
    failures = []
    for role, (text, expect) in cases.items():
        path = tmp_path / f"{role}.toml"
        path.write_text(f'[run]\nname = "{keys.run}"\ndata_dir = "{tmp_path / "data"}"\n{text}')
        r = subprocess.run(
            [sys.executable, "-m", "streamer", role, "--config", str(path), "--redis-url", redis_url],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN,
            check=False,
        )
        lines = r.stderr.strip().splitlines()
        if not (r.returncode == 2 and len(lines) == 1 and expect in lines[0]):
            failures.append(f"{role}: exit {r.returncode}, stderr:\n{r.stderr[-1500:]}")
    written = sorted(k.decode() for k in client.scan_iter(match=keys.all_keys_pattern()))
    files = (
        sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "data").rglob("*"))
        if (tmp_path / "data").exists()
        else []
    )
    report(
        "config-errors-found-by-roles",
        cases=len(cases),
        clear_exit_2=len(cases) - len(failures),
        keys_written=len(written),
        files_written=len(files),
    )
    assert not failures, "\n\n".join(failures)
    assert written == [] and files == [], (written, files)


URL_ROLES = ("up", "train", "produce", "eval", "metrics", "status")


def _url_cases(closed: int, plain: int) -> list[tuple[str, int, str]]:
    """(URL, exit code, what its one line says); ``plain``: a server that is no cluster."""
    return [
        ("redis://[::1", 2, "cannot be used: Invalid IPv6 URL"),
        ("redis://[zz::1]:6379/0", 2, "'zz::1' does not appear to be an IPv4 or IPv6 address"),
        ("redis://user:s3cr[t@127.0.0.1:1/0", 2, "must be percent-encoded"),
        (f"redis+cluster://127.0.0.1:{closed}", 1, "cannot reach the server at"),
        (f"redis+cluster://127.0.0.1:{plain}", 1, "Cluster mode is not enabled"),
        (f"redis+cluster://127.0.0.1:{plain}/3", 2, "a cluster has only database 0"),
    ]


def test_every_role_says_in_one_line_what_is_wrong_with_its_server_url(private_valkey, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cases = [(role, *case) for case in _url_cases(free_port(), private_valkey.port) for role in URL_ROLES]
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "streamer", role, "--redis-url", url, "--data-dir", str(tmp_path / role)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, url, _, _ in cases
    ]
    failures = []
    for (role, url, code, expect), proc in zip(cases, running, strict=True):
        wrong = _not_one_line(proc, code=code, prefix=f"streamer {role}: ", expect=expect, hidden="s3cr")
        if wrong is not None:
            failures.append(f"{role} {url}: {wrong}")
    report(
        "bad-server-urls",
        roles=len(URL_ROLES),
        cases=len(cases),
        clear=len(cases) - len(failures),
        crashed=sum("Traceback" in f for f in failures),
    )
    assert not failures, "\n\n".join(failures)
