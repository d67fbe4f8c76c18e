"""Quantized linear layers: formats read from ``quantization_config`` and the CPU/CUDA kernels that run them.

config.py parses and refuses; one module per format (awq, gptq, compressed_tensors, fp8)
says what tensors a layer keeps and how they turn into a ``QuantizedWeight`` (base.py);
kernels.py picks the matmul (fp8_kernels.py: the CUDA fp8 ones); linear.py is the layer the
models build; experts.py keeps a MoE block's experts quantized.
"""
