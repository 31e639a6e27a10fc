"""Policy weights on disk: hashed while written, verified by manifest or by every byte,
loaded with one copy into the model; bad files are refused before anything changes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from schemas import WeightSync
from streamer import demo, tensorfile, weights
from streamer.errors import WeightsError


def _sync(uri: str, sha: str, version: int = 1) -> WeightSync:
    return WeightSync(version=version, step=version, uri=uri, sha256=sha)


def test_written_version_loads_back_exactly_and_its_manifest_matches_a_full_hash(tmp_path):
    src, dst = demo.build_model(seed=1), demo.build_model(seed=2)
    uri, sha = weights.write_version(src, tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    manifest = json.loads((path / weights.MANIFEST).read_text())
    assert sha == weights.digest(path) == manifest["sha256"]
    assert manifest["files"]["model.safetensors"]["sha256"] == weights.sha256_file(path / "model.safetensors")
    assert {"config.json", "model.safetensors"} <= manifest["files"].keys()
    for mode in ("manifest", "full"):
        assert weights.resolve(_sync(uri, sha), tmp_path, verify=mode) == path
    weights.load_into(dst, path)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name
    from safetensors.torch import load_file  # the file is plain safetensors for any reader

    assert load_file(path / "model.safetensors").keys() <= src.state_dict().keys()


def test_manifest_mode_refuses_a_wrong_sha_or_a_truncated_file_and_full_mode_a_flipped_byte(tmp_path):
    uri, sha = weights.write_version(demo.build_model(seed=1), tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        weights.resolve(_sync(uri, "0" * 64), tmp_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed: only a full re-hash can tell
    (path / "model.safetensors").write_bytes(bytes(data))
    assert weights.resolve(_sync(uri, sha), tmp_path, verify="manifest") == path
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        weights.resolve(_sync(uri, sha), tmp_path, verify="full")
    (path / "model.safetensors").write_bytes(bytes(data[:-4]))
    with pytest.raises(WeightsError, match="bytes, manifest.json says"):
        weights.resolve(_sync(uri, sha), tmp_path)
    (path / weights.MANIFEST).unlink()  # no manifest: always hashed
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        weights.resolve(_sync(uri, sha), tmp_path, verify="manifest")


def test_a_version_written_on_this_machine_before_its_last_boot_is_hashed_in_full(tmp_path):
    uri, sha = weights.write_version(demo.build_model(seed=1), tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the sizes survive, the bytes do not: what a lost page cache can leave
    (path / "model.safetensors").write_bytes(bytes(data))
    manifest = json.loads((path / weights.MANIFEST).read_text())
    assert manifest["written_by"] == weights.this_boot()

    def written_by(**by) -> None:
        manifest["written_by"] = {**weights.this_boot(), **by}
        (path / weights.MANIFEST).write_text(json.dumps(manifest))

    written_by(boot_id="an-earlier-boot")
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        weights.resolve(_sync(uri, sha), tmp_path, verify="manifest")
    # another machine's boot says nothing about this one's page cache: the manifest stands
    written_by(host="another-host", boot_id="its-boot")
    assert weights.resolve(_sync(uri, sha), tmp_path, verify="manifest") == path


def test_tensorfile_round_trips_dtypes_and_refuses_bad_headers(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    sha, size = tensorfile.write(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    assert size == (tmp_path / "t.safetensors").stat().st_size
    assert sha == weights.sha256_file(tmp_path / "t.safetensors")
    params = {k: torch.zeros_like(v) for k, v in tensors.items()}
    assert tensorfile.load_into(params, tmp_path / "t.safetensors") == set(tensors)
    assert all(torch.equal(params[k], tensors[k]) for k in tensors)
    with pytest.raises(WeightsError, match="is F32\\[3, 5\\], the model's"):
        tensorfile.load_into({**params, "a": torch.zeros(5, 3)}, tmp_path / "t.safetensors")
    head = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16)
    with pytest.raises(WeightsError, match="offsets that do not match"):
        tensorfile.header(tmp_path / "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(WeightsError, match="does not fit the file"):
        tensorfile.header(tmp_path / "short.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_finds_any_nan_or_inf_wherever_it_is(dtype):
    for n in (1, 7, 1000, 65_537):
        clean = torch.randn(n).to(dtype)
        assert tensorfile.finite(clean)
        for pos in {0, n // 3, n - 1}:
            for bad in (float("nan"), float("inf"), -float("inf")):
                poisoned = clean.clone()
                poisoned[pos] = bad
                assert not tensorfile.finite(poisoned), (n, pos, bad)
                assert not tensorfile.finite(poisoned.view(1, n).t()), (n, pos, bad)


def test_a_file_with_a_nan_is_refused_before_any_parameter_changes(tmp_path):
    src, dst = demo.build_model(seed=1), demo.build_model(seed=2)
    state = weights._unaliased(src.state_dict(), weights.tied_keys(src))
    name = "model.layers.1.mlp.up_proj.weight"
    state[name] = state[name].clone()
    state[name][3, 4] = float("nan")
    tensorfile.write(tmp_path / "model.safetensors", state)
    before = {k: t.clone() for k, t in dst.state_dict().items()}
    with pytest.raises(WeightsError, match=f"{name}.*inf or NaN"):
        tensorfile.load_into(dst.state_dict(), tmp_path / "model.safetensors")
    assert all(torch.equal(t, before[k]) for k, t in dst.state_dict().items())
