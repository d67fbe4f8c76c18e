"""``/metrics`` of a server on a quantized checkpoint: ``quant_config_info`` names the format and its kernels."""

from __future__ import annotations

import httpx
import pytest
from api_factories import API_KEY, MODEL_NAME, live_server
from prometheus_client.parser import text_string_to_metric_families
from quant_writers import F32_KERNEL, write_quantized

from pagedllm.kernels import w4_gemm_cpu
from pagedllm.server.entrypoints.openai.api_server import ServerSettings
from pagedllm.server.worker.models.cpu_linear import onednn_bf16

pytestmark = pytest.mark.timeout(180)
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BFLOAT16_INT4 = (
    "w4a8-tiles"
    if w4_gemm_cpu.int8_available()
    else "w4a16-tiles"
    if w4_gemm_cpu.available()
    else "int4-cpu+unpacked-bfloat16-from-64-rows"
    if onednn_bf16()
    else "int4-cpu"
)
"""What runs a bfloat16 4-bit projection here: the tiled kernel where the CPU has AVX-512-BF16 or AVX2, on
int8 activations where its int8 product runs (VNNI and VBMI, or AVX2)."""


def quant_config_info(url: str) -> dict[str, str]:
    """The labels of the one ``pagedllm:quant_config_info`` sample the server exports."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    [info] = [f for f in families if f.name == "pagedllm:quant_config_info"]
    [sample] = info.samples
    assert sample.value == 1.0
    return sample.labels


@pytest.mark.parametrize(
    ("dtype", "int4"),
    [("bfloat16", BFLOAT16_INT4), ("float32", "int4-cpu-unpacked-float32")],
)
def test_an_awq_server_exports_its_method_kernels_and_bytes(tmp_path, dtype, int4):
    qdir, _ = write_quantized(str(tmp_path), "awq", seed=3)
    with live_server(qdir, dtype=dtype) as server:
        labels = quant_config_info(server.url)
        weights = server.app.state.engine.model_info.weights
        banner = weights.banner()
    assert labels["model_name"] == "tiny"
    assert (labels["method"], labels["format"], labels["bits"], labels["group_size"]) == ("awq", "awq", "4", "32")
    assert {labels[f"kernel_{kind}"] for kind in KINDS} == {int4}
    # NOTE: the checkpoint leaves the LM head unquantized; oneDNN has no bfloat16 GEMM on an AVX2-only CPU,
    # and the vocabulary is no multiple of 16, so a float32 head stays with oneDNN
    head = "onednn-packed" if dtype == "float32" or onednn_bf16() else "torch-linear"
    assert labels["kernel_lm_head"] == head
    assert int(labels["weight_bytes"]) == weights.weight_bytes > 0
    assert banner.startswith("awq awq 4-bit group 32, kernels: down_proj " + int4)


def test_a_plain_checkpoint_says_none(tmp_path):
    _, twin = write_quantized(str(tmp_path), "awq", seed=3)
    with live_server(twin) as server:
        labels = quant_config_info(server.url)
    assert (labels["method"], labels["format"], labels["bits"], labels["group_size"]) == ("none", "none", "32", "-1")
    assert {labels[f"kernel_{kind}"] for kind in KINDS} == {F32_KERNEL}


def test_an_engine_core_process_reports_its_weights_too(tmp_path):
    """The summary is built where the weights are (the engine-core process) and reaches the API process."""
    qdir, _ = write_quantized(str(tmp_path), "awq", seed=4)
    settings = ServerSettings(served_model_names=[MODEL_NAME], api_key=API_KEY, engine_core="process")
    with live_server(qdir, settings) as server:
        labels = quant_config_info(server.url)
    assert (labels["method"], labels["bits"], labels["group_size"]) == ("awq", "4", "32")
    assert labels["kernel_gate_up_proj"] == "int4-cpu-unpacked-float32" and int(labels["weight_bytes"]) > 0
