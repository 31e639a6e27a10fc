"""Policy weights on disk: hashed piece by piece while written, announced by the sha256 of
their manifest, verified by it or by every piece, loaded into the model without a copy; bad files are
refused before anything changes."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from blake3 import blake3

from schemas import WeightSync
from streamer import demo, pieces, tensorfile, weights
from streamer.errors import WeightsError


def _sync(uri: str, sha: str, version: int = 1) -> WeightSync:
    return WeightSync(version=version, step=version, uri=uri, sha256=sha)


def test_written_version_loads_back_exactly_and_its_manifest_matches_a_full_hash(tmp_path):
    src, dst = demo.build_model(seed=1), demo.build_model(seed=2)
    uri, sha = weights.write_version(src, tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    assert sha == hashlib.sha256((path / weights.MANIFEST).read_bytes()).hexdigest()
    manifest = json.loads((path / weights.MANIFEST).read_text())
    assert {"config.json", "model.safetensors"} <= manifest["files"].keys()
    for name, listed in manifest["files"].items():
        st = (path / name).stat()
        assert listed == {
            "bytes": st.st_size,
            "pieces": _pieces(path / name),
            "written": [st.st_ino, st.st_mtime_ns, st.st_ctime_ns],
        }
    for mode in ("manifest", "full"):
        assert weights.resolve(_sync(uri, sha), tmp_path, verify=mode) == path
    weights.load_into(dst, path)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name
    from safetensors.torch import load_file  # the file is plain safetensors for any reader

    assert load_file(path / "model.safetensors").keys() <= src.state_dict().keys()


def _pieces(path, piece: int = pieces.PIECE) -> list[str]:
    """The definition, one piece after the other: the BLAKE3 of each ``piece`` bytes."""
    data = path.read_bytes()
    return [blake3(data[i : i + piece]).hexdigest() for i in range(0, len(data), piece)]


def _mapped(path) -> bool:
    """Whether this process maps the file at ``path`` (deleted or not)."""
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_mapped_load_shares_the_file_yet_owns_its_writes_and_outlives_the_directory(tmp_path):
    src = demo.build_model(seed=1)
    weights.write_version(src, tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    f = path / "model.safetensors"
    on_disk = f.read_bytes()
    a, b, c = demo.build_model(seed=2), demo.build_model(seed=3).to(torch.bfloat16), demo.build_model(seed=4)
    weights.load_into(c, path)  # a trainer's load (a checkpoint's weights): copied
    weights.load_into(b, path, mapped=True)  # another dtype: cast and copied
    assert not _mapped(f)
    weights.load_into(a, path, mapped=True)
    assert _mapped(f)
    for model in (a, b, c):
        for (name, want), got in zip(src.state_dict().items(), model.state_dict().values()):
            assert torch.equal(want.to(got.dtype), got), name
    head = a.lm_head.weight
    assert head is a.model.embed_tokens.weight  # still tied
    with torch.no_grad():
        for p in a.parameters():
            p.add_(1.0)  # the model's own page copies, never the file
    assert f.read_bytes() == on_disk
    shutil.rmtree(path)
    assert torch.equal(head, src.lm_head.weight + 1.0)
    weights.write_version(src, tmp_path, 2)
    weights.load_into(a, weights.version_dir(tmp_path, 2), mapped=True)
    del head
    gc.collect()
    assert not _mapped(f), "the deleted version's space is held after the model moved on"


def test_pieces_written_on_several_threads_are_the_bytes_and_their_hashes(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE", 1000)  # many pieces, cut inside and across buffers
    monkeypatch.setattr(pieces, "THREADS", 3)
    buffers = [b"h" * 10, bytes(range(256)) * 9, b"", torch.randn(700).numpy(), b"t" * 1000]
    hashes, size = pieces.write(tmp_path / "f", buffers)
    data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert (tmp_path / "f").read_bytes() == data and size == len(data) == 6114
    assert hashes == _pieces(tmp_path / "f", 1000) == pieces.of_file(tmp_path / "f", 1000)
    assert len(hashes) == 7 and pieces.write(tmp_path / "empty", []) == ([], 0)


def test_a_wrong_sha_a_truncated_file_or_a_flipped_byte_is_refused(tmp_path):
    uri, sha = weights.write_version(demo.build_model(seed=1), tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        weights.resolve(_sync(uri, "0" * 64), tmp_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed: written since, so hashed again
    (path / "model.safetensors").write_bytes(bytes(data))
    for mode in weights.VERIFY_MODES:
        with pytest.raises(WeightsError, match="blake3 mismatch"):
            weights.resolve(_sync(uri, sha), tmp_path, verify=mode)
    (path / "model.safetensors").write_bytes(bytes(data[:-4]))
    with pytest.raises(WeightsError, match="bytes, manifest.json says"):
        weights.resolve(_sync(uri, sha), tmp_path)
    manifest = json.loads((path / weights.MANIFEST).read_text())
    manifest["files"]["model.safetensors"]["bytes"] -= 4  # the manifest made to fit: its hash changes
    (path / weights.MANIFEST).write_text(json.dumps(manifest))
    for mode in weights.VERIFY_MODES:
        with pytest.raises(WeightsError, match="sha256 mismatch"):
            weights.resolve(_sync(uri, sha), tmp_path, verify=mode)
    (path / weights.MANIFEST).unlink()  # nothing to check the bytes against
    with pytest.raises(WeightsError, match="cannot read manifest.json"):
        weights.resolve(_sync(uri, sha), tmp_path, verify="full")


def test_full_mode_finds_a_changed_byte_in_any_piece_and_an_older_manifest_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE", 4096)
    uri, sha = weights.write_version(demo.build_model(seed=1), tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    original = (path / "model.safetensors").read_bytes()
    assert len(original) > 20 * 4096
    for at in (5, 4096 * 7 + 11, len(original) - 1):
        data = bytearray(original)
        data[at] ^= 0x01
        (path / "model.safetensors").write_bytes(bytes(data))
        piece = at // 4096 * 4096
        with pytest.raises(WeightsError, match=f"blake3 mismatch in bytes {piece}-"):
            weights.resolve(_sync(uri, sha), tmp_path, verify="full")
    # an older trainer's manifests: per-file sha256 (1), the pieces' sha256 (2)
    for form in (1, 2):
        old = {"format": form, "version": 1, "piece_bytes": 4096, "files": {}}
        (path / weights.MANIFEST).write_text(json.dumps(old))
        with pytest.raises(WeightsError, match=f"format {form}, this build reads 3"):
            weights.resolve(_sync(uri, "a" * 64), tmp_path)


def test_manifest_mode_trusts_only_files_as_the_writer_left_them_in_this_boot(tmp_path, monkeypatch):
    uri, sha = weights.write_version(demo.build_model(seed=1), tmp_path, 1)
    path = weights.version_dir(tmp_path, 1)
    f = path / "model.safetensors"
    original = f.read_bytes()
    manifest = json.loads((path / weights.MANIFEST).read_text())
    assert manifest["written_by"] == weights.this_boot()
    hashed = []
    of_file = pieces.of_file
    monkeypatch.setattr(pieces, "of_file", lambda p, *a: hashed.append(p.name) or of_file(p, *a))
    assert weights.resolve(_sync(uri, sha), tmp_path) == path and hashed == []
    f.write_bytes(original)  # written to since, the same bytes: re-hashed, and they pass
    assert weights.resolve(_sync(uri, sha), tmp_path) == path and "model.safetensors" in hashed
    # a copy with one byte changed put in its place, its times set back to the original's
    st = f.stat()
    (path / "copy").write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    os.utime(path / "copy", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(path / "copy", f)
    with pytest.raises(WeightsError, match="blake3 mismatch in bytes"):
        weights.resolve(_sync(uri, sha), tmp_path)

    def written_by(by: dict | None) -> WeightSync:
        """The version as if its manifest said it was written ``by`` (None: not saying),
        announced by the sha256 of that manifest."""
        manifest.pop("written_by", None)
        if by is not None:
            manifest["written_by"] = {**weights.this_boot(), **by}
        (path / weights.MANIFEST).write_text(json.dumps(manifest))
        return _sync(uri, hashlib.sha256((path / weights.MANIFEST).read_bytes()).hexdigest())

    # an earlier boot (what a lost page cache can leave), not saying, another machine: the
    # files' times say nothing about the bytes there, which are hashed in full
    for by in ({"boot_id": "an-earlier-boot"}, None, {"host": "another-host", "boot_id": "its-boot"}):
        with pytest.raises(WeightsError, match="blake3 mismatch in bytes"):
            weights.resolve(written_by(by), tmp_path, verify="manifest")


def test_tensorfile_round_trips_dtypes_and_refuses_bad_headers(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    sha, size = tensorfile.write(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    assert size == (tmp_path / "t.safetensors").stat().st_size
    assert sha == _pieces(tmp_path / "t.safetensors")
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
    huge = torch.full((64,), torch.finfo(dtype).max / 2).to(dtype)  # finite, but its sum is not
    assert not bool(torch.isfinite(huge.sum())) and tensorfile.finite(huge) and tensorfile.finite(-huge)


def test_a_check_sees_every_byte_once_before_it_is_written_and_stops_the_write(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE", 1000)
    monkeypatch.setattr(pieces, "_SLICE", 300)  # slices cut inside pieces and buffers
    monkeypatch.setattr(pieces, "THREADS", 3)
    buffers = [b"h" * 10, bytes(range(256)) * 9, b"", b"t" * 1000]
    seen: list[tuple[int, int, int]] = []
    hashes, _ = pieces.write(tmp_path / "f", buffers, lambda i, b, e: seen.append((i, b, e)))
    assert hashes == _pieces(tmp_path / "f", 1000)
    for i, buf in enumerate(buffers):  # each buffer's ranges tile it exactly
        ranges = sorted((b, e) for j, b, e in seen if j == i)
        assert [b for b, _ in ranges] == [0, *(e for _, e in ranges[:-1])] if buf else not ranges
        assert not buf or ranges[-1][1] == len(buf)

    def refuse(i, b, e):
        if i == 3:
            raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        pieces.write(tmp_path / "g", buffers, refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_writer_refuses_inf_or_nan_anywhere_even_across_slices_and_unaligned(
    tmp_path, monkeypatch, dtype
):
    monkeypatch.setattr(pieces, "PIECE", 1000)
    monkeypatch.setattr(pieces, "_SLICE", 250)
    monkeypatch.setattr(pieces, "THREADS", 2)
    clean = {"odd": torch.randn(3).to(torch.bfloat16), "w": torch.randn(997).to(dtype), "i": torch.arange(5)}
    tensorfile.write(tmp_path / "ok.safetensors", clean, finite_only=True)  # finite: written
    size = clean["w"].element_size()
    for pos in (0, 1, 249 // size, 250 // size, 251 // size, 500, 996):  # around a slice's edge
        for bad in (float("nan"), float("inf"), -float("inf")):
            tensors = {**clean, "w": clean["w"].clone()}
            tensors["w"][pos] = bad
            with pytest.raises(tensorfile.NonFinite, match="'w' holds inf or NaN") as e:
                tensorfile.write(tmp_path / "bad.safetensors", tensors, finite_only=True)
            assert e.value.tensor == "w"
    tensorfile.write(tmp_path / "unchecked.safetensors", tensors)  # unless asked


def test_a_version_with_a_nan_is_never_written_and_nothing_appears(tmp_path):
    model = demo.build_model(seed=1)
    weights.write_version(model, tmp_path, 1)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(weights.NonFinite, match="up_proj"):
        weights.write_version(model, tmp_path, 2)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = 1e6  # finite in float32, inf in float16
    with pytest.raises(weights.NonFinite, match="up_proj"):
        weights.write_version(model, tmp_path, 3, dtype=torch.float16)
    assert weights.versions(tmp_path) == [1] and [p.name for p in tmp_path.iterdir()] == ["v00000001"]


def test_each_version_s_config_files_are_transformers_own_and_follow_a_changed_attribute(tmp_path):
    """A run writes the same config with every version; what is written is what transformers
    writes for it, cast or untied as asked, and a changed attribute shows in the next one."""
    import copy

    model = demo.build_model(0)
    cases = [(None, False), (None, False), (torch.bfloat16, False), (None, True), (None, False)]
    for i, (dtype, untie) in enumerate(cases):
        ours, theirs = tmp_path / f"ours{i}", tmp_path / f"theirs{i}"
        ours.mkdir()
        theirs.mkdir()
        weights.save(model, ours, dtype=dtype, untie=untie)
        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = config.tie_word_embeddings and not untie
        if dtype is not None:
            config.dtype = dtype
        config.to_json_file(theirs / "config.json")
        model.generation_config.to_json_file(theirs / "generation_config.json")
        for name in ("config.json", "generation_config.json"):
            assert (ours / name).read_text() == (theirs / name).read_text(), (dtype, untie, name)
    model.config.use_cache = not model.config.use_cache
    (tmp_path / "changed").mkdir()
    weights.save(model, tmp_path / "changed")
    assert (
        json.loads((tmp_path / "changed" / "config.json").read_text())["use_cache"] is model.config.use_cache
    )
