"""Data read from object storage: s3://bucket/prefix sources on the SeaweedFS S3 server of tests/s3_server.py,
read by Ray Data in Ray's worker processes with the credentials of the environment (AWS_* variables, as a
node has them), mixed with a second S3 source (a gzip-compressed one) and counted per source; and the same
preflight as checkpoint storage: wrong keys or an endpoint nobody answers at stop before Ray, naming what was
tried."""
from __future__ import annotations

import gzip
import json

import pytest

from raytune_ft.data.packing import DataCounters
from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate
from tests.conftest import own_ray
from tests.mlflow_server import free_port


@pytest.fixture(scope="module")
def s3_data(s3_server, fixtures):
    """A bucket with UltraChat rows (jsonl) and Capybara rows (jsonl.gz) under prefixes of their own, and a
    local Ray whose processes have the server's AWS_* variables."""
    import ray

    bucket = s3_server.bucket()
    fs = s3_server.filesystem()
    data = fixtures / "data"
    with fs.open_output_stream(f"{bucket}/chat/ultrachat/train-00000-of-00001.jsonl") as f:
        f.write((data / "ultrachat_200k_train_sft_first16.jsonl").read_bytes())
    # compression=None: pyarrow would gzip a .gz path again on the way up
    with fs.open_output_stream(f"{bucket}/chat/capybara/part-0.jsonl.gz", compression=None) as f:
        f.write(gzip.compress((data / "capybara_ldjnr_first16.jsonl").read_bytes()))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        own_ray(address="local", num_cpus=4, include_dashboard=False)
        try:
            yield bucket
        finally:
            ray.shutdown()


def _sources(bucket: str) -> str:
    return json.dumps([{"source": f"s3://{bucket}/chat/ultrachat", "name": "ultrachat"},
                       {"source": f"s3://{bucket}/chat/capybara", "name": "capybara", "weight": 2}])


@pytest.mark.timeout(600)
def test_a_two_source_mixture_on_s3_is_read_by_ray_data_and_counted_per_source(s3_data, fixtures):
    from raytune_ft.driver import preflight
    from raytune_ft.data.pipeline import build_dataset, iter_blocks

    recipe = validate(apply_overrides(Recipe(), [f"data.sources={_sources(s3_data)}", "data.seq_len=4096",
                                                 "data.pack_window=8"]))
    lines = preflight.check_data_source(recipe)
    assert lines == ["data: ultrachat: format messages (picked by its fields, 16 first rows read)",
                     "data: capybara: format conversation (picked by its fields, 16 first rows read)"]
    ds = build_dataset(recipe.data, str(fixtures / "tokenizers" / "qwen3"))
    c = DataCounters()
    blocks = list(iter_blocks(ds, recipe.data, counters=c))
    u, cap = c.by_source["ultrachat"], c.by_source["capybara"]
    # each row read once; capybara's weight 2 uses each of its trained rows twice
    assert (u["rows_read"], cap["rows_read"], cap["conversations"]) == (16, 16, 2 * cap["trained"])
    assert c.rows_skipped == 0
    assert u["tokens"] + cap["tokens"] == c.real_tokens and len(blocks) == c.blocks > 0


def test_an_s3_source_with_wrong_keys_or_no_server_stops_before_ray(s3_server, monkeypatch):
    from raytune_ft.driver import preflight
    bucket = s3_server.bucket()
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    recipe = validate(apply_overrides(Recipe(), [f"data.source=s3://{bucket}/chat"]))
    with pytest.raises(RecipeError) as e:
        preflight.check_data_source(recipe)
    msg = str(e.value)
    assert msg.startswith(f"data.source: s3://{bucket}/chat cannot be read") and "AWS_SECRET_ACCESS_KEY" in msg
    assert "not-the-secret" not in msg
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RecipeError, match="(?s)cannot be read: the endpoint cannot be reached.*endpoint: http://127.0.0.1"):
        preflight.check_data_source(validate(apply_overrides(Recipe(), [f"data.source=s3://{bucket}/chat"])))
