"""The data lake: every command on s3:// URLs against a real S3 endpoint (moto's server on
127.0.0.1, port 0, module scope, reset between tests, fake credentials)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptctl import synth

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
    from tests.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(local_ckpt, tmp_path / "back")
    info = cli.json("inspect", f"{bucket}/tp4")
    assert info["layout"]["tp"] == 4


def test_s3_consolidate_to_hf_and_plan_uses_the_s3_profile(
    bucket: str, local_ckpt: Path, tmp_path: Path, cli
) -> None:
    cli("reshard", local_ckpt, f"{bucket}/tp2", "--tp", "2", "--pp", "2")
    cli("consolidate", f"{bucket}/tp2", tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["vocab_size"] == 1100
    on_s3 = cli.json("plan", f"{bucket}/tp2", tmp_path / "x", "--tp", "4", "--pp", "1")
    local = cli.json("plan", local_ckpt, tmp_path / "x", "--tp", "4", "--pp", "1")
    assert on_s3["estimates"]["seconds"] > 10 * local["estimates"]["seconds"]
