"""benchmarks/gpu_step.py, the GPU benchmark, runs end to end at a tiny shape on the CPU (the HF engine; its vLLM
path is the engine code tests/test_vllm_cpu.py covers): random-weight completions run to the forced length, the
trainer reproduces the sampling log-probs, and every phase is timed."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_gpu_step_at_a_tiny_shape(tmp_path):
    """The one-GPU check's steps, plain and under FSDP2 with one process (--fsdp), with LoRA: the betas cycled (0: no
    reference pass), the update repeated from a checkpoint (FSDP2: the adapters' shards alone) equal to the first, a
    peak and an estimate reported; then grpo.py's --self_check; one report of both."""
    out = tmp_path / "gpu_step.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--shape", "tiny", "--engines", "hf", "--steps",
                           "4", "--prompts", "4", "--generations", "2", "--new_tokens", "16", "--prompt_len", "8",
                           "--micro_batch_size", "4", "--fsdp", "--lora_rank", "4", "--self_check",
                           "--self_check_flags", "--engine hf --prompts_per_step 4 --num_generations 2 "
                           "--micro_batch_size 8", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, sharded = [json.loads(line) for line in open(out)]
    assert (plain["fsdp2"], sharded["fsdp2"]) == (False, True) and "| hf | True | 4 | cpu |" in proc.stdout
    report = (tmp_path / "gpu_step.md").read_text()
    assert "| hf | True | 4 | cpu |" in report and "exit code 0" in report and "| resume | PASS |" in report
    for result in (plain, sharded):
        assert result["engine"] == "hf" and result["resume"]["equal"] and result["trainer_estimate_gb"] > 0
        assert [step["beta"] for step in result["steps"]] == [0.04, 0.04, 0.0, 0.0]
        for step in result["steps"]:  # random weights sample a stop token (1 in 1,024) now and then
            assert 4 * 2 * 12 <= step["tokens"] <= 4 * 2 * 16 and step["truncated_frac"] >= 0.5
            assert step["logprob_gap_max"] < 1e-4 and step["step_s"] >= step["rollout_s"] > 0


@pytest.mark.slow
def test_gpu_step_tail_mode_at_a_tiny_shape(tmp_path):
    """--tail: grpo.py's rollout against grpo_async.py's on long-tailed lengths (a share of the vocabulary stops)."""
    out = tmp_path / "gpu_step.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--tail", "--shape", "tiny", "--engines", "hf",
                           "--steps", "4", "--prompts", "4", "--generations", "4", "--new_tokens", "64",
                           "--prompt_len", "8", "--micro_batch_size", "4", "--stop_frac", "0.05", "--out", str(out)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in open(out)]
    assert "| hf | cpu |" in proc.stdout and result["rollout_ratio"] > 0
    sync, partial = result["sync"], result["async"]
    for step in sync["steps"]:  # every group to its end: the step's decode calls are its longest completion's
        assert step["decode_calls"] == step["longest"] <= 64 and step["trained_tokens"] == step["generated_tokens"]
    assert partial["decode_calls"] < sync["decode_calls"]  # stopped once 4 of 6 groups were whole
    assert all(step["trained_tokens"] > 0 for step in partial["steps"])


def test_each_result_is_written_as_it_ends(tmp_path, monkeypatch):
    """A failing FSDP2 launch (the second half) loses none of the results before it: each is on disk as it ends."""
    sys.path.insert(0, ROOT)
    import benchmarks.gpu_step as gpu_step

    def fsdp2_launches(opts):
        yield {"engine": "hf", "fsdp2": True, "n": 2}
        raise subprocess.CalledProcessError(1, "accelerate launch")

    monkeypatch.setattr(gpu_step.torch, "set_num_threads", lambda n: None)  # this test process's own stay as they are
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    monkeypatch.setattr(gpu_step, "build_model", lambda shape, path: None)
    monkeypatch.setattr(gpu_step, "run_engine", lambda name, opts, model_dir: {"engine": name, "fsdp2": False, "n": 1})
    monkeypatch.setattr(gpu_step, "under_fsdp2", fsdp2_launches)
    out = tmp_path / "gpu_step.jsonl"
    monkeypatch.setattr(sys, "argv", ["gpu_step.py", "--shape", "tiny", "--engines", "hf", "--fsdp", "--out", str(out)])
    with pytest.raises(subprocess.CalledProcessError):
        gpu_step.main()
    assert [json.loads(line)["n"] for line in open(out)] == [1, 2]


def test_a_repeated_update_is_the_same_bit_for_bit_on_a_cpu_and_within_1e_4_on_a_gpu(monkeypatch):
    sys.path.insert(0, ROOT)
    import torch

    from benchmarks.gpu_step import same_update

    assert same_update((0.5, 2.0), (0.5, 2.0)) and not same_update((0.5, 2.0), (0.5, 2.0 + 1e-12))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU kernels: atomic adds reorder the sums
    assert same_update((0.5, 2.0), (0.5 + 1e-6, 2.0)) and not same_update((0.5, 2.0), (0.5, 2.01))
