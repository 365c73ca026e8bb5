"""The data lake: every command on s3:// URLs against a real S3 endpoint (moto's server on
127.0.0.1, port 0, module scope, reset between tests, fake credentials)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptctl import synth
from tests.s3proxy import S3Proxy

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
        )
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[str]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="lake")
    yield "s3://lake"
    for obj in client.list_objects_v2(Bucket="lake").get("Contents", []):
        client.delete_object(Bucket="lake", Key=obj["Key"])
    client.delete_bucket(Bucket="lake")
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=9)
    out = tmp_path_factory.mktemp("s3") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=9), out, tp=2, pp=2)
    return out


def test_local_to_s3_to_s3_to_local_is_bit_exact(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    cli("consolidate", local_ckpt, f"{bucket}/full", "--format", "megatron")
    cli("reshard", f"{bucket}/full", f"{bucket}/tp4", "--tp", "4", "--pp", "1")
    cli("reshard", f"{bucket}/tp4", tmp_path / "back", "--tp", "2", "--pp", "2")
    report = cli.json("verify", f"{bucket}/tp4", "--against", local_ckpt)
    assert report["ok"] and all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(local_ckpt, tmp_path / "back")
    info = cli.json("inspect", f"{bucket}/tp4")
    assert info["layout"]["tp"] == 4


def test_s3_consolidate_to_hf_and_plan_uses_the_s3_profile(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    cli("reshard", local_ckpt, f"{bucket}/tp2", "--strategy", "direct")  # an upload
    cli("consolidate", f"{bucket}/tp2", tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["vocab_size"] == 1100
    on_s3 = cli.json("plan", f"{bucket}/tp2", tmp_path / "x", "--tp", "4", "--pp", "1")
    local = cli.json("plan", local_ckpt, tmp_path / "x", "--tp", "4", "--pp", "1")
    assert on_s3["estimates"]["seconds"] > 10 * local["estimates"]["seconds"]


# --- what goes over the wire: counted by a proxy in front of the server -------------------------

METADATA_ALLOWANCE = 256 << 10
"""Per object: zip end record, central directory and pickle, each fetched with at most one
128 KiB read-ahead block past what was asked."""


@pytest.fixture(scope="module")
def proxy(s3_endpoint: str) -> Iterator[S3Proxy]:
    server = S3Proxy(s3_endpoint).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Large enough (~40 MB, two thirds Adam state) that metadata reads are small beside it."""
    config = synth.tiny_llama_config(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704
    )
    model = synth.make_model(config, seed=3)
    out = tmp_path_factory.mktemp("s3wide") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=3), out, tp=2, pp=2)
    return out


def _upload(local: Path, url: str) -> None:
    import s3fs

    s3fs.S3FileSystem().put(str(local), url.removeprefix("s3://"), recursive=True)


def _bytes_by_source_file(plan: dict) -> dict[str, int]:
    import torch

    out: dict[str, int] = {}
    for file in plan["files"]:
        itemsize = None
        for tensor in file["tensors"]:
            itemsize = getattr(torch, tensor["dtype"]).itemsize
            for copy in tensor["copies"]:
                path = plan["source_files"][copy["source"]]
                n = 1
                for s in copy["sizes"]:
                    n *= s
                out[path] = out.get(path, 0) + n * itemsize
    return out


def test_reads_fetch_only_the_byte_ranges_the_plan_needs(
    bucket: str, proxy: S3Proxy, wide_ckpt: Path, tmp_path: Path, cli
) -> None:
    _upload(wide_ckpt, f"{bucket}/src")
    plan = cli.json("consolidate", f"{bucket}/src", tmp_path / "hf", "--dry-run")
    needed = _bytes_by_source_file(plan)
    proxy.reset()
    done = cli.json("--endpoint-url", proxy.url, "consolidate", f"{bucket}/src", tmp_path / "hf")
    checks = done["read_for_record_checks"]

    fetched: dict[str, int] = {}
    for r in proxy.gets("lake/src/"):
        assert r.range is not None, f"whole-object GET of {r.key}"
        rel = r.key.removeprefix("lake/src/")
        fetched[rel] = fetched.get(rel, 0) + r.sent
    sizes = {p.relative_to(wide_ckpt).as_posix(): p.stat().st_size for p in wide_ckpt.rglob("*.pt")}
    assert set(fetched) <= set(sizes) | {"latest_checkpointed_iteration.txt"}
    for path, size in sizes.items():
        want = needed.get(path, 0)
        got = fetched.get(path, 0)
        assert want <= got <= want + METADATA_ALLOWANCE + checks["bytes"]
        assert got < size / 2, "the Adam state was fetched although HF needs weights only"
    assert sum(needed.values()) == plan["estimates"]["bytes_read"]
    # The padded vocabulary rows of the last TP rank's embedding are not needed, but fetched
    # once to check that record's CRC-32 (the rest of each record the job reads passes anyway).
    extra = sum(fetched.values()) - sum(needed.values())
    assert 0 < checks["bytes"] <= extra <= checks["bytes"] + METADATA_ALLOWANCE * len(sizes)
    # Requests: the plan's ranged reads, plus per file the zip end records, directory and
    # pickle (zipfile reads the end in up to four small pieces), plus a 30-byte local-header
    # read for a record whose first read starts inside it (else the header rides along).
    gets = len(proxy.gets("lake/src/"))
    headers = sum(r.sent == 30 for r in proxy.gets("lake/src/"))
    assert plan["estimates"]["read_requests"] <= gets
    import zipfile

    records = sum(
        sum("/data/" in n for n in zipfile.ZipFile(wide_ckpt / path).namelist()) for path in sizes
    )
    allowed = plan["estimates"]["read_requests"] + 6 * len(sizes) + headers + checks["records"]
    assert gets <= allowed
    assert headers <= records // 5, "local headers were fetched one request each"


def test_transient_failures_are_retried_and_the_result_is_bit_exact(
    bucket: str, proxy: S3Proxy, wide_ckpt: Path, tmp_path: Path, cli
) -> None:
    """Every 20th data request is answered 503 SlowDown or has its connection dropped; botocore's
    retry policy takes it from there (reads, multipart parts, the manifest PUT alike)."""
    _upload(wide_ckpt, f"{bucket}/src")
    proxy.reset()
    proxy.fail_every = 20
    lake = ("--endpoint-url", proxy.url, "--part-size", "5MiB")
    cli(*lake, "reshard", f"{bucket}/src", f"{bucket}/tp1", "--tp", "1", "--pp", "4")
    assert proxy.failures >= 5
    parts = [r for r in proxy.requests if r.method == "PUT" and "partNumber" in r.query]
    assert len(parts) >= 8, "expected multipart uploads at a 5 MiB part size"
    proxy.fail_every = 0
    report = cli.json("verify", f"{bucket}/tp1", "--against", wide_ckpt)
    assert report["ok"] and all(t["max_abs_diff"] == 0.0 for t in report["tensors"])


def test_multipart_upload_commits_atomically_and_aborts_without_a_trace(bucket: str) -> None:
    import s3fs

    from ckptctl.io.multipart import MultipartUpload

    fs = s3fs.S3FileSystem()
    data = os.urandom(12 << 20)
    upload = MultipartUpload(fs, "lake/obj", part_size=5 << 20, parallel=3)
    for i in range(0, len(data), 1 << 20):
        upload.write(data[i : i + (1 << 20)])
    assert not fs.exists("lake/obj"), "visible before completion"
    upload.commit()
    assert fs.cat_file("lake/obj") == data

    failed = MultipartUpload(fs, "lake/broken", part_size=5 << 20, parallel=3)
    failed.write(data)
    failed.abort()
    client = boto3.client("s3")
    assert not client.list_multipart_uploads(Bucket="lake").get("Uploads")
    fs.invalidate_cache()
    assert not fs.exists("lake/broken")


@pytest.mark.parametrize("before", [0, 1000, 6 << 20])
def test_a_range_of_an_object_is_copied_by_the_server_between_written_bytes(
    bucket: str, before: int
) -> None:
    """Bytes written, a range of another object copied on the server, bytes written again:
    the object is exactly their concatenation whatever the part being filled held (nothing,
    less than S3's 5 MiB minimum, more), every byte of the range reached the observers, and
    only the lead that completed a part passed through this process."""
    import s3fs

    from ckptctl.io.multipart import MultipartUpload, copy_run_on_server
    from ckptctl.io.runs import Run
    from ckptctl.io.storage import Storage

    store = Storage(bucket)
    fs = store.fs  # the same store on both sides: a server-side copy applies
    source = os.urandom(40 << 20)
    fs.pipe("lake/source.bin", source)
    head, tail = os.urandom(before), os.urandom(3 << 20)
    start, length = 1234, 20 << 20
    upload = MultipartUpload(fs, "lake/out.bin", part_size=8 << 20, parallel=2)
    upload.write(head)
    seen: list[int] = []
    run = Run("s3://lake/source.bin", start, length, "float32", storage=store, rel="source.bin")
    copied = copy_run_on_server(upload, run, [lambda view: seen.append(len(view))])
    upload.write(tail)
    upload.commit()
    fs.invalidate_cache()
    assert fs.cat_file("lake/out.bin") == head + source[start : start + length] + tail
    assert sum(seen) == length
    lead = (5 << 20) - before if 0 < before < 5 << 20 else 0
    assert copied == length - lead
    other = MultipartUpload(
        s3fs.S3FileSystem(anon=False, skip_instance_cache=True), "lake/x", 8 << 20, 1
    )
    assert copy_run_on_server(other, run, []) is None  # another client: not the same store


def test_a_failed_write_leaves_no_object_and_a_rerun_aborts_stale_uploads(
    bucket: str, local_ckpt: Path, cli
) -> None:
    client = boto3.client("s3")
    client.create_multipart_upload(Bucket="lake", Key="out/iter_0000001/left-by-a-killed-run")
    cli("reshard", local_ckpt, f"{bucket}/out", "--tp", "1", "--pp", "1")
    assert not client.list_multipart_uploads(Bucket="lake").get("Uploads")

    from ckptctl.io.storage import Storage

    target = Storage(f"{bucket}/other")
    with pytest.raises(RuntimeError), target.open_write("half.bin") as f:
        f.write(os.urandom(11 << 20))  # two parts already sent
        raise RuntimeError("the job fails mid-file")
    assert not target.exists("half.bin")
    assert not client.list_multipart_uploads(Bucket="lake").get("Uploads")


def test_stage_dir_writes_locally_first_and_commits_after_the_last_upload(
    bucket: str, proxy: S3Proxy, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    stage = tmp_path / "nvme"
    proxy.reset()
    cli(
        "--endpoint-url",
        proxy.url,
        "reshard",
        local_ckpt,
        f"{bucket}/staged",
        "--tp",
        "4",
        "--pp",
        "1",
        "--stage-dir",
        stage,
    )
    assert not [p for p in stage.rglob("*") if p.is_file()], "uploaded files stay on the stage"
    writes = [
        (i, r.key)
        for i, r in enumerate(proxy.requests)
        if r.method in ("PUT", "POST") and r.status < 300 and r.key.startswith("lake/staged/")
    ]
    manifest_at = max(i for i, k in writes if k.endswith("ckptctl.manifest.json"))
    data_at = [i for i, k in writes if k.endswith(".pt")]
    assert data_at and max(data_at) < manifest_at
    report = cli.json("verify", f"{bucket}/staged", "--against", local_ckpt)
    assert report["ok"] and all(t["max_abs_diff"] == 0.0 for t in report["tensors"])


def test_torch_dist_on_s3_reads_records_by_range(
    bucket: str, proxy: S3Proxy, wide_ckpt: Path, tmp_path: Path, cli
) -> None:
    """A DCP checkpoint in the lake: each tensor record is located through ``.metadata`` and
    its bytes fetched by range; the pickle and zip directory of a record cost at most two small
    reads at its edges."""
    cli("reshard", wide_ckpt, tmp_path / "td", "--tp", "2", "--pp", "1", "--format", "torch_dist")
    _upload(tmp_path / "td", f"{bucket}/td")
    plan = cli.json("consolidate", f"{bucket}/td", tmp_path / "hf", "--dry-run")
    proxy.reset()
    done = cli.json("--endpoint-url", proxy.url, "consolidate", f"{bucket}/td", tmp_path / "hf")
    gets = proxy.gets("lake/td/")
    assert all(r.range is not None for r in gets if r.key.endswith(".distcp"))
    fetched = sum(r.sent for r in gets if r.key.endswith(".distcp"))
    records = {
        (c["source"], tuple(c["key"]))
        for f in plan["files"]
        for t in f["tensors"]
        for c in t["copies"]
    }
    needed = plan["estimates"]["bytes_read"]
    total = sum(p.stat().st_size for p in (tmp_path / "td").rglob("*.distcp"))
    checked = done["read_for_record_checks"]["bytes"]  # the padded vocabulary rows
    assert needed <= fetched <= needed + len(records) * 2 * (16 << 10) + checked
    assert fetched < total / 2, "optimizer records were fetched for a weights-only target"
    report = cli.json("verify", tmp_path / "hf", "--against", wide_ckpt, "--weights-only")
    assert report["ok"]


def test_memory_and_file_urls_work_like_paths(local_ckpt: Path, tmp_path: Path, cli) -> None:
    """fsspec URLs other than S3: ``memory://`` (in-process) and ``file://``."""
    cli("reshard", f"file://{local_ckpt}", "memory://lake/tp4", "--tp", "4", "--pp", "1")
    cli("reshard", "memory://lake/tp4", f"file://{tmp_path}/back", "--tp", "2", "--pp", "2")
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(local_ckpt, tmp_path / "back")
    assert cli.json("verify", "memory://lake/tp4", "--against", local_ckpt)["ok"]


def test_a_missing_bucket_is_a_one_line_storage_error(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    result = cli("consolidate", local_ckpt, "s3://no-such-bucket/out", code=4)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert (
        errors and "bucket does not exist" in errors[0] and "s3://no-such-bucket/out" in errors[0]
    )
    assert "Traceback" not in result.stderr
    missing = cli("inspect", "s3://no-such-bucket/ckpt", code=3)
    assert "no such checkpoint" in missing.stderr


def test_a_large_range_is_fetched_as_parallel_sub_ranges(bucket: str, proxy: S3Proxy) -> None:
    import s3fs

    from ckptctl.io.storage import RANGE_PART, Storage
    from ckptctl.settings import StorageConfig

    data = os.urandom(3 * RANGE_PART + 12345)
    s3fs.S3FileSystem().pipe("lake/big.bin", data)
    proxy.reset()
    storage = Storage(f"{bucket}", StorageConfig(endpoint_url=proxy.url))
    got = storage.read_range("big.bin", 1000, len(data) - 2000)
    assert got == data[1000:-1000]
    ranges = sorted(r.range for r in proxy.gets("lake/big.bin"))
    assert len(ranges) == 3 and all(r is not None for r in ranges)


# --- first-run safety on object stores ------------------------------------------------------------


def test_an_s3_destination_overlapping_its_source_is_refused_whatever_the_spelling(
    bucket: str, local_ckpt: Path, cli
) -> None:
    cli("reshard", local_ckpt, f"{bucket}/ck", "--strategy", "direct")  # an upload
    before = sorted(s3_keys(bucket))
    for dst in (f"{bucket}/ck/", "s3a://lake//ck", f"{bucket}/ck/out", bucket):
        result = cli("reshard", f"{bucket}/ck", dst, "--tp", "1", "--overwrite", code=2)
        assert "never writes into or over a source" in result.stderr, dst
    assert sorted(s3_keys(bucket)) == before


def s3_keys(bucket: str) -> list[tuple[str, str]]:
    client = boto3.client("s3")
    listed = client.list_objects_v2(Bucket=bucket.removeprefix("s3://")).get("Contents", [])
    return [(o["Key"], o["ETag"]) for o in listed]


def test_a_saved_plan_refuses_an_object_rewritten_with_the_same_size(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    import s3fs

    cli("reshard", local_ckpt, f"{bucket}/ck", "--strategy", "direct")  # an upload
    plan = tmp_path / "plan.json"
    cli("plan", f"{bucket}/ck", tmp_path / "out", "--tp", "1", "--out", plan)
    key = "lake/ck/iter_0000001/mp_rank_01_001/model_optim_rng.pt"
    fs = s3fs.S3FileSystem()
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 1
    fs.pipe(key, bytes(data))
    s3fs.S3FileSystem.clear_instance_cache()
    result = cli("reshard", f"{bucket}/ck", tmp_path / "out", "--plan", plan, code=3)
    assert "mp_rank_01_001/model_optim_rng.pt (changed)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_credentials_are_a_storage_error(
    bucket: str, s3_endpoint: str, monkeypatch, tmp_path: Path, cli
) -> None:
    import s3fs

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
    s3fs.S3FileSystem.clear_instance_cache()
    result = cli("inspect", f"{bucket}/ck", "--json", code=4)
    doc = json.loads(result.stdout)
    assert "no credentials" in doc["error"] and "AWS_ACCESS_KEY_ID" in doc["hint"]
    s3fs.S3FileSystem.clear_instance_cache()


def test_compressed_checkpoints_live_in_the_lake(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    """compress s3 -> s3 (alone and as a delta against another S3 checkpoint), every command
    reading the result there, and decompress s3 -> local restoring every byte."""
    from tests.pipeline.test_reshard import assert_same_checkpoint

    cli("reshard", local_ckpt, f"{bucket}/step", "--strategy", "direct")  # an upload
    cli("reshard", local_ckpt, f"{bucket}/base", "--strategy", "direct")  # an upload
    alone = cli.json("compress", f"{bucket}/step", f"{bucket}/packed")
    delta = cli.json("compress", f"{bucket}/step", f"{bucket}/delta", "--base", f"{bucket}/base")
    assert alone["ratio"] > 1 and delta["ratio"] > 10 * alone["ratio"]  # identical to its base
    for packed in ("packed", "delta"):
        assert cli.json("verify", f"{bucket}/{packed}")["ok"]
        assert "ratio" in " ".join(cli.json("inspect", f"{bucket}/{packed}")["notes"])
        cli("consolidate", f"{bucket}/{packed}", tmp_path / f"{packed}-hf")
        cli("decompress", f"{bucket}/{packed}", tmp_path / f"{packed}-back")
        assert_same_checkpoint(local_ckpt, tmp_path / f"{packed}-back")
    cli("consolidate", local_ckpt, tmp_path / "plain-hf")
    for packed in ("packed", "delta"):
        a = (tmp_path / f"{packed}-hf/model.safetensors").read_bytes()
        assert a == (tmp_path / "plain-hf/model.safetensors").read_bytes()


def test_quantizing_in_the_lake(bucket: str, local_ckpt: Path, tmp_path: Path, cli) -> None:
    """compress --quantize of a checkpoint on S3 to S3: tensors located by ranged reads, the
    result read there by every command and held to its recorded errors."""
    import zipfile

    cli("reshard", local_ckpt, f"{bucket}/step", "--strategy", "direct")  # an upload
    report = cli.json("compress", f"{bucket}/step", f"{bucket}/q", "--quantize", "all")
    assert report["ratio"] > 2
    checks = cli.json("verify", f"{bucket}/q", "--against", local_ckpt)
    assert checks["ok"], checks
    assert any("quantized_max_abs_error" in t for t in checks["tensors"])
    cli("decompress", f"{bucket}/q", tmp_path / "back")
    for path in (tmp_path / "back").rglob("*.pt"):
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None, path
    assert cli.json("verify", tmp_path / "back")["ok"]


def test_a_reshard_from_the_lake_refuses_a_corrupt_record_it_reads_only_part_of(
    bucket: str, tmp_path: Path, cli
) -> None:
    """Each TP2 rank reads half the columns of the row-parallel weight: neither read can check
    the record, so the halves' CRC-32s are joined as they pass, and the job fails before
    anything is marked complete. On an intact copy only the rows no file needs are fetched
    for the checks: TP1's vocabulary padding of the embedding and output layer, and of their
    two Adam moments (six records)."""
    from tests.cli.test_first_run import _record_span

    config = synth.tiny_llama_config(num_layers=1)
    model = synth.make_model(config, seed=2)
    ck = tmp_path / "tp1"
    synth.write_megatron(model, synth.adam_step(model, seed=2), ck, tp=1, pp=1)
    _upload(ck, f"{bucket}/intact")
    done = cli.json("reshard", f"{bucket}/intact", tmp_path / "ok", "--tp", "2")
    padding = synth.padded_vocab_size(config.vocab_size, 1) - config.vocab_size
    row = config.hidden_size * 4  # float32
    assert done["read_for_record_checks"] == {"records": 6, "bytes": 6 * padding * row}
    path = ck / "iter_0000001/mp_rank_00/model_optim_rng.pt"
    start, end = _record_span(path, "decoder.layers.0.self_attention.linear_proj.weight")
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    _upload(ck, f"{bucket}/corrupt")
    result = cli("reshard", f"{bucket}/corrupt", tmp_path / "out", "--tp", "2", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and "s3://lake/corrupt/iter_0000001" in line, line
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()
