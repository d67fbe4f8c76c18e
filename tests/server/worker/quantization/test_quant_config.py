"""What is refused at start-up, with the value and what is allowed, and what ``--quantization`` means."""

from __future__ import annotations

import pytest
from quant_writers import write_quantized

from pagedllm.server import LLM
from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.config.quantization import quant_config_from_hf, with_quantization

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}


def parse(qc: dict):
    return quant_config_from_hf({"quantization_config": qc})


def test_formats_are_read_from_the_checkpoint_config():
    assert quant_config_from_hf({}) is None
    awq = parse(AWQ)
    assert (awq.format, awq.bits, awq.group_size, awq.sym) == ("awq", 4, 128, False)
    gptq = parse(GPTQ)
    assert gptq.desc_act and not gptq.sym and gptq.zeros_minus_one
    assert not parse({**GPTQ, "checkpoint_format": "gptq_v2"}).zeros_minus_one
    fp8 = parse({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert fp8.format == "fp8-block" and fp8.block == (128, 128)


@pytest.mark.parametrize(
    ("qc", "field", "shown"),
    [
        ({**AWQ, "version": "gemv"}, "quantization_config.version", "'gemv'"),
        ({**AWQ, "bits": 3}, "quantization_config.bits", "3"),
        ({**AWQ, "group_size": 256}, "quantization_config.group_size", "256"),
        ({**GPTQ, "bits": 2}, "quantization_config.bits", "2"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format", "'marlin'"),
        ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method", "'bitsandbytes'"),
        ({**AWQ, "modules_to_not_convert": ["visual"]}, "quantization_config.ignore", "['visual']"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "quantization_config.activation_scheme", "static"),
    ],
)
def test_unsupported_options_are_refused_by_name(qc, field, shown):
    with pytest.raises(ConfigError) as info:
        parse(qc)
    assert info.value.field == field and shown in str(info.value)


def test_unsupported_compressed_tensors_schemes_are_refused():
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 16}
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": scheme}}
    with pytest.raises(ConfigError, match="nvfp4-pack-quantized.*is not supported"):
        parse(qc)
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "actorder": "group",
    }
    qc = {**qc, "format": "pack-quantized", "config_groups": {"g": {**scheme, "weights": weights}}}
    with pytest.raises(ConfigError, match="actorder"):
        parse(qc)


def test_the_flag_is_checked_against_the_checkpoint_or_quantizes_online():
    plain = {"model_type": "llama"}
    assert with_quantization(plain, None) is plain
    online = with_quantization(plain, "int8")
    assert parse(online["quantization_config"]).format == "online-int8"
    assert with_quantization(online, "int8") == online  # NOTE: the ranks apply it again
    awq = {"quantization_config": AWQ}
    assert with_quantization(awq, "awq") is awq
    with pytest.raises(ConfigError, match="'awq' \\(what the checkpoint holds\\)"):
        with_quantization(awq, "gptq")
    with pytest.raises(ConfigError, match="fp8"):
        with_quantization(plain, "awq")
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(quantization="gguf")
    assert info.value.field == "quantization"


def test_a_shard_that_cuts_a_group_is_refused(tmp_path):
    qdir, _ = write_quantized(str(tmp_path), "awq", group=128)  # o_proj: 128 inputs, 64 per rank
    with pytest.raises(ConfigError) as info:
        LLM(model=qdir, tensor_parallel_size=2, num_gpu_blocks_override=16)
    assert info.value.field == "tensor_parallel_size" and "qzeros" in str(info.value)


def test_models_without_quantized_layers_refuse_quantization(tmp_path):
    from engine_factories import save_tiny

    opt = save_tiny(str(tmp_path / "opt"), "opt", seed=1)
    with pytest.raises(ConfigError) as info:
        LLM(model=opt, quantization="int8", num_gpu_blocks_override=8)
    assert info.value.field == "quantization" and "OPTForCausalLM" in str(info.value)
