"""Quantized linear layers: formats read from ``quantization_config`` and the CPU/CUDA kernels that run them.

config.py parses and refuses; one module per format (awq, gptq, compressed_tensors, fp8)
says what tensors a layer keeps and how they turn into a ``QuantizedWeight`` (base.py);
kernels.py picks the matmul; linear.py is the layer the models build.
"""
