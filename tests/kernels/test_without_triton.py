"""pagedllm.kernels imports and its references run when triton is not installed."""

import subprocess
import sys
import textwrap


def test_references_work_and_launchers_explain_without_triton():
    script = textwrap.dedent(
        """
        import sys

        class BlockTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")

        sys.meta_path.insert(0, BlockTriton())
        import torch
        import pagedllm.kernels as k

        assert not k.HAS_TRITON
        cache = torch.zeros(4, 2, 1, 8)
        key = torch.ones(1, 1, 8)
        k.reshape_and_cache_reference(key, key, cache, cache, torch.tensor([3]))
        assert cache[1, 1].sum() == 8
        try:
            k.reshape_and_cache(key, key, cache, cache, torch.tensor([3]))
        except RuntimeError as err:
            assert "pagedllm[triton]" in str(err), err
        else:
            raise AssertionError("the Triton launcher ran without triton")
        from pagedllm.kernels import fp8_matmul, fused_add_rms_norm, quant_matmul, rotary_embedding, silu_and_mul
        from pagedllm.server.worker.models import decoder

        assert not decoder.runs_on_triton(torch.zeros(1))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
