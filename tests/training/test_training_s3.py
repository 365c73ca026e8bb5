"""The training-loop API against an object store (moto's S3 server, behind a proxy that records
every request): a save streams its shard file as multipart parts and writes ``.metadata`` and
then the manifest last; a load reads it back by range."""

from __future__ import annotations

import torch

from ckptctl.settings import StorageConfig
from ckptctl.training import Checkpointer
from tests.io.test_s3 import bucket, proxy, s3_endpoint  # noqa: F401  (fixtures)
from tests.s3proxy import S3Proxy

PART = 5 << 20


def test_a_save_streams_parts_and_commits_last_and_loads_back(
    bucket: str,  # noqa: F811
    proxy: S3Proxy,  # noqa: F811
    cli,
) -> None:
    torch.manual_seed(0)
    state = {
        "model": {"big": torch.randn(3 << 20), "small": torch.randn(7, 3).to(torch.bfloat16)},
        "step": 5,
    }
    url = f"{bucket}/run/step_5"
    saver = Checkpointer(storage=StorageConfig(endpoint_url=proxy.url, part_size=PART))
    proxy.reset()
    report = saver.save(state, checkpoint_id=url)
    assert report.files == [".metadata", "__0_0.distcp", "ckptctl.manifest.json"]

    writes = [
        (i, r)
        for i, r in enumerate(proxy.requests)
        if r.method in ("PUT", "POST") and r.status < 300 and r.key.startswith("lake/run/step_5/")
    ]
    parts = [i for i, r in writes if r.key.endswith(".distcp") and "partNumber" in r.query]
    metadata = [i for i, r in writes if r.key.endswith("/.metadata")]
    manifest = [i for i, r in writes if r.key.endswith("/ckptctl.manifest.json")]
    assert len(parts) >= 2, "the shard file goes up in parts, not as one body"
    assert max(parts) < min(metadata) and max(metadata) < min(manifest)
    assert manifest[-1] == writes[-1][0], "the manifest is the last object written"

    again = {
        "model": {"big": torch.zeros(3 << 20), "small": torch.zeros(7, 3, dtype=torch.bfloat16)},
        "step": 0,
    }
    proxy.reset()
    loaded = saver.load(again, checkpoint_id=url)
    assert loaded.strategy == "direct" and again["step"] == 5
    assert all(torch.equal(again["model"][k], v) for k, v in state["model"].items())
    assert sum(r.sent for r in proxy.gets("lake/run/step_5/__0_0.distcp")) < 1.01 * (3 << 22)
    saver.close()

    verified = cli.json("--endpoint-url", proxy.url, "verify", url)
    assert verified["ok"]


def test_tiers_keep_the_newest_locally_and_every_nth_step_in_the_lake(
    bucket: str,  # noqa: F811
    s3_endpoint: str,  # noqa: F811
    tmp_path,
) -> None:
    import boto3
    import pytest

    from ckptctl.errors import CheckpointError
    from ckptctl.training import Retention, Tiers

    nvme, lake = tmp_path / "nvme", f"{bucket}/run"
    tiers = Tiers(str(nvme), lake, Retention(keep_local=2, lake_every=2))
    saver = Checkpointer(tiers=tiers, storage=StorageConfig(endpoint_url=s3_endpoint))
    states = {}
    for step in range(5):
        states[step] = {"w": torch.full((64, 64), float(step)), "step": step}
        saver.async_save(states[step], checkpoint_id=f"step_{step}", step=step)
    saver.wait()
    assert sorted(p.name for p in nvme.iterdir()) == ["step_3", "step_4"]
    keys = {
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_endpoint)
        .list_objects_v2(Bucket="lake")
        .get("Contents", [])
    }
    manifests = sorted(k for k in keys if k.endswith("ckptctl.manifest.json"))
    assert manifests == [f"run/step_{s}/ckptctl.manifest.json" for s in (0, 2, 4)]
    assert not any(k.endswith("ckptctl.incomplete") for k in keys)

    local = {"w": torch.zeros(64, 64), "step": -1}
    assert saver.load(local, checkpoint_id="step_4").checkpoint_id == str(nvme / "step_4")
    assert torch.equal(local["w"], states[4]["w"]) and local["step"] == 4
    lost = {"w": torch.zeros(64, 64), "step": -1}  # this node lost it: the lake has it
    assert saver.load(lost, checkpoint_id="step_2").checkpoint_id == f"{lake}/step_2"
    assert torch.equal(lost["w"], states[2]["w"]) and lost["step"] == 2
    with pytest.raises(CheckpointError, match="step_1"):  # pruned here, never sent to the lake
        saver.load({"w": torch.zeros(64, 64)}, checkpoint_id="step_1")
    with pytest.raises(Exception, match="step="):
        saver.async_save(states[0], checkpoint_id="step_9")
    saver.close()


def test_two_ranks_stream_their_files_to_s3_at_once(
    bucket: str,  # noqa: F811
    proxy: S3Proxy,  # noqa: F811
) -> None:
    """Observed at the server: both ranks' parts arrive interleaved (each file is streamed
    while the other is still being written), and ``.metadata`` and the manifest come last."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "s3_save.py"
    proxy.reset()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), f"{bucket}/two/step_3"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "AWS_ENDPOINT_URL": proxy.url},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]

    def written(r) -> bool:
        part = r.method == "PUT" and "partNumber" in r.query
        whole = r.method == "PUT" and r.key.endswith(("/.metadata", "/ckptctl.manifest.json"))
        return r.status < 300 and r.key.startswith("lake/two/") and (part or whole)

    writes = [r for r in proxy.requests if written(r)]
    names = [r.key.rsplit("/", 1)[-1] for r in writes]
    spans = {
        f: (min(r.arrived for r in rs), max(r.answered for r in rs), len(rs))
        for f in ("__0_0.distcp", "__1_0.distcp")
        if (rs := [r for r in writes if r.key.endswith(f)])
    }
    assert len(spans) == 2 and all(n >= 3 for _, _, n in spans.values()), names
    (start_a, end_a, _), (start_b, end_b, _) = spans.values()
    assert start_b < end_a and start_a < end_b, f"the files went up one after the other: {spans}"
    last = sorted(writes, key=lambda r: r.arrived)[-2:]
    assert [r.key.rsplit("/", 1)[-1] for r in last] == [".metadata", "ckptctl.manifest.json"]


def test_ranks_loading_halves_of_a_record_from_s3_check_it_together(
    bucket: str,  # noqa: F811
    proxy: S3Proxy,  # noqa: F811
    tmp_path,
) -> None:
    """A tensor saved whole, loaded by two ranks each taking half of its rows: the record is
    checked from the two halves the ranks fetched (nothing is fetched twice), and a flipped
    byte in it fails the load on both ranks, naming the record, where it loaded silently."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import boto3

    torch.manual_seed(0)
    w = torch.randn(1 << 10, 1 << 10)
    saver = Checkpointer(storage=StorageConfig(endpoint_url=proxy.url))
    for name in ("intact", "corrupt", "alone"):
        saver.save({"w": w}, checkpoint_id=f"{bucket}/{name}/step_1")
    client = boto3.client("s3", endpoint_url=proxy.url)
    key = "corrupt/step_1/__0_0.distcp"
    raw = bytearray(client.get_object(Bucket="lake", Key=key)["Body"].read())
    at = raw.index(w[768].numpy().tobytes()[:64])  # in the second rank's half
    raw[at + 5] ^= 0x08
    client.put_object(Bucket="lake", Key=key, Body=bytes(raw))

    proxy.reset()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).parent / "s3_load_parts.py"), str(tmp_path),
         f"{bucket}/intact/step_1", f"{bucket}/corrupt/step_1", f"{bucket}/alone/step_1"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "AWS_ENDPOINT_URL": proxy.url},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (intact_0, corrupt_0, alone), (intact_1, corrupt_1) = (
        json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)
    )
    assert intact_0.get("strategy") == intact_1.get("strategy") == "reshard", intact_0
    assert intact_0["rows"] == w[0, :4].tolist() and intact_1["rows"] == w[512, :4].tolist()
    nothing = {"records": 0, "bytes": 0}
    assert intact_0["read_for_record_checks"] == intact_1["read_for_record_checks"] == nothing
    fetched = sum(r.sent for r in proxy.gets("lake/intact/step_1/__0_0.distcp"))
    assert fetched < 1.05 * w.numel() * 4, "a rank fetched the other's half to check it"

    # One rank loading alone (no_dist=True) fetches the half it did not load, to check it.
    assert alone["alone"] == {"records": 1, "bytes": w.numel() * 4 // 2}

    errors = [corrupt_0.get("error", ""), corrupt_1.get("error", "")]
    assert all("fails its CRC-32 check" in e for e in errors), errors
    assert any("failed to load" in e for e in errors), errors
