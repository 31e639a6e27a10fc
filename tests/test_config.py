"""Config: TOML into Structs, every bad key named; the CLI exits 2 on a bad config."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bounds import START

from streamer import demo
from streamer.cli.configdoc import render
from streamer.config import ConfigError, RunConfig, load_config, parse_config


def test_no_config_is_the_demo():
    cfg = demo.config()
    assert cfg.model.name_or_path == "demo" and cfg.producer.dataset == "demo"
    assert cfg.producer.reward == "streamer.demo:reward" and cfg.trainer.steps > 0


def test_a_full_file_parses(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text(
        '[run]\nname = "gsm8k"\nredis_url = "redis://10.0.0.1:6379/0"\n'
        "[trainer]\ngroups_per_step = 16\nmax_staleness = 0\nlr = 1e-6\n"
        '[producer]\nsampler = "remote"\nremote_url = "http://127.0.0.1:8000"\n'
    )
    cfg = load_config(p)
    assert cfg.run.name == "gsm8k" and cfg.trainer.groups_per_step == 16
    assert cfg.trainer.max_staleness == 0 and cfg.producer.sampler == "remote"
    assert cfg.weights_dir.parts[-2:] == ("gsm8k", "weights")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[trainer]\nlr = -1\n", "key `trainer.lr`: must be > 0"),
        ("[producer]\ntop_p = 1.5\n", "key `producer.top_p`: must be <= 1"),
        ("[model.lora]\ndropout = 1.0\n", "key `model.lora.dropout`: must be < 1"),
        ("[trainer]\nbogus = 1\n", "unknown key `trainer.bogus`"),
        ("[nope]\n", "unknown key `nope`"),
        ('[trainer]\ngroups_per_step = "8"\n', "key `trainer.groups_per_step`: Expected `int`, got `str`"),
        ("[producer]\ngroup_size = 0\n", "key `producer.group_size`: must be >= 1"),
        (
            "[producer]\ngroup_size = 2\nmin_group_size = 4\n",
            "key `producer.min_group_size`: must be <= `group_size`",
        ),
        ('[producer]\nsampler = "remote"\n', "key `producer.remote_url`: is required"),
        ('[trainer]\nloss_agg = "median"\n', "key `trainer.loss_agg`: Invalid enum value 'median'"),
        ("[bus]\nblock_seconds = 30.0\n", "key `bus.socket_timeout`"),
        ("[metrics]\nport = 70000\n", "key `metrics.port`"),
        ("[trainer]\nfsdp = true\n[model.lora]\nrank = 8\n", "key `trainer.fsdp`: LoRA adapters"),
        ("[trainer\n", "not valid TOML"),
    ],
)
def test_bad_configs_name_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="run.toml")
    assert str(err.value).startswith("run.toml: ")
    assert message in str(err.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.slow
def test_cli_exits_2_with_one_line_naming_the_key(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[trainer]\nmax_staleness = -1\n")
    r = subprocess.run(
        [sys.executable, "-m", "streamer", "smoke", "--config", str(p)],
        capture_output=True,
        text=True,
        timeout=START,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"streamer smoke: config error: {p}: key `trainer.max_staleness`: must be >= 0"
    ]


def test_config_reference_documents_every_key():
    doc = render()
    cfg = RunConfig()
    import msgspec

    def keys(prefix, obj):  # nested sections ([trainer.dapo]) are documented key by key
        for f in msgspec.structs.fields(type(obj)):
            value = getattr(obj, f.name)
            name = f"{prefix}.{f.name}" if prefix else f.name
            yield from keys(name, value) if isinstance(value, msgspec.Struct) else [name]

    names = list(keys("", cfg))
    assert "trainer.dapo.eps_clip_c" in names
    for name in names:
        line = next(ln for ln in doc.splitlines() if ln.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"{name}: not a 4-cell row: {line}"
        assert cells[1] != "``" and cells[3], f"{name} has no type or no doc: {line}"


def test_readme_config_reference_is_current():
    from pathlib import Path

    from streamer.cli.configdoc import sync

    readme = Path(__file__).resolve().parent.parent / "README.md"
    assert sync(readme, check=True), "README config reference is stale: streamer config-doc --write README.md"


def test_to_toml_round_trips_a_whole_config_with_awkward_strings():
    import msgspec

    from streamer.config import to_toml

    tree = msgspec.to_builtins(demo.config())
    tree["run"]["data_dir"] = 'a "quoted" \\ path\nwith a newline, ünïcode and a # hash'
    tree["model"]["lora"].update(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    assert msgspec.to_builtins(parse_config(to_toml(tree))) == tree
