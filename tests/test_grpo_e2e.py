"""grpo.py end to end on the embedded model: 1 and 2 processes, resume, eval-only, a local MATH-shaped file, bad input,
the --help text, and the learning check (the reward rises)."""

import json
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import grpo
import tests.helpers
from tests.helpers import ROOT, SMALL, resolved, run_grpo, two_processes
from grpo import StepStats
from plumbing.run import RunArgs, find_checkpoint, run_name


def test_import_has_no_side_effects(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import grpo, sys; print(sorted(m for m in sys.modules "
                           "if m in ('vllm', 'wandb', 'accelerate')))"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_micro_batch_size_default_divides_the_mini_batch():
    assert resolved(grpo).micro_batch_size == 32  # the embedded model's default
    assert resolved(grpo, prompts_per_step=2, num_generations=4).micro_batch_size == 8  # the whole mini-batch
    assert resolved(grpo, prompts_per_step=3, num_generations=4).micro_batch_size == 12  # the whole mini-batch
    assert resolved(grpo, prompts_per_step=10, num_generations=4).micro_batch_size == 20  # the largest divisor <= 32
    assert resolved(grpo, prompts_per_step=10, num_generations=4, num_minibatches=2).micro_batch_size == 20
    assert resolved(grpo, micro_batch_size=2).micro_batch_size == 2


def test_help_shows_each_fields_docstring_the_algorithms_flags_first():  # every field's flag: test_shared_blocks
    out = subprocess.run([sys.executable, "grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    helps = [line for line in out.splitlines() if line.strip().lstrip("│ ").startswith("--")]
    assert len(helps) > 30 and all(len(line.split()) > 1 for line in helps)
    assert "G, completions per prompt" in out  # the field docstrings became the help text
    # GRPO's own flags, then the model and the rollout, then the run's plumbing
    assert out.index("--num-generations") < out.index("--clip-eps") < out.index("--model") < out.index(
        "--prompts-per-step") < out.index("--output-dir") < out.index("--resume")


def test_run_names_two_commands_never_share_a_folder():
    """The default run is grpo__1; any other flag that changes what the run computes changes the name; the plumbing
    flags (threads, output folder, resume) do not; --exp_name names the run."""
    def name(**flags):
        run = RunArgs(**{k: v for k, v in flags.items() if k in RunArgs.__dataclass_fields__})
        args = grpo.Args(run=run, **{k: v for k, v in flags.items() if k not in RunArgs.__dataclass_fields__})
        return run_name("grpo", args, args.exp_name, args.model, args.task, args.seed)

    assert name() == "grpo__1" and name(seed=2) == "grpo__2"
    readme = name(model="smollm2-135m", task="rg:chain_sum:min_terms=2,max_terms=3", learning_rate=1e-5)
    assert readme.startswith("grpo__smollm2-135m__rg-chain_sum__") and readme.endswith("__1")
    others = {name(beta=0.0), name(learning_rate=1e-4), name(engine="vllm"), name(task="toy_mul"), readme,
              name(model="smollm2-135m", task="rg:chain_sum:min_terms=2,max_terms=4", learning_rate=1e-5)}
    assert len(others) == 6 and "grpo__1" not in others
    assert name(beta=0.0) == name(beta=0.0, threads=2, output_dir="elsewhere", resume=True,  # --resume finds it
                                  malloc_mmap_threshold=4 << 20)
    assert name(beta=0.0, exp_name="mine") == "mine__1"


MAPPED_BYTES = """
import ctypes, sys, torch
from plumbing.run import set_mmap_threshold
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
set_mmap_threshold(int(sys.argv[1]))
torch.empty(8 << 20, dtype=torch.uint8)  # mapped on its own and freed at once: a dynamic threshold rises above it
before = libc.mallinfo2().hblkhd
held = torch.empty(6 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)  # the bytes glibc mapped for the 6 MiB tensor, 0 if it came from the heap
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="--malloc_mmap_threshold sets glibc's malloc")
def test_the_mmap_threshold_maps_large_tensors_on_their_own_and_the_environment_wins():
    """--malloc_mmap_threshold (plumbing/run.set_mmap_threshold), read off glibc's own counts (mallinfo2): at 4 MiB a
    6 MiB tensor is mapped on its own (its memory goes back to the system when freed), also after a larger block was
    freed; at 0, glibc's default, that free lifts the threshold and the tensor comes from the heap; a
    MALLOC_MMAP_THRESHOLD_ in the environment is left to rule."""
    def mapped(threshold, **env):
        proc = subprocess.run([sys.executable, "-c", MAPPED_BYTES, str(threshold)], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT, **env), check=True)
        return int(proc.stdout)

    assert mapped(4 << 20) >= 6 << 20
    assert mapped(0) == 0
    assert mapped(4 << 20, MALLOC_MMAP_THRESHOLD_=str(16 << 20)) == 0


def test_step_metrics_are_the_rollouts_and_the_phases_add_up_to_the_step():
    """A step's statistics as grpo.py combines them: the rollout's (rollout_stats, in the script) and the run-wide
    times and throughput (plumbing/run.py step_times), reduced over processes by StepStats.reduce."""
    import time
    import types

    from accelerate import Accelerator

    from plumbing.engine import Sample
    from plumbing.run import step_times

    samples = [Sample([5, 6, 7], [-0.1] * 3, False), Sample([5], [-0.2], True)]
    counts = {"no_answer": 1, "unparsed": 0, "timeouts": 2, "verify_timeouts": 0, "errors": 0, "memory": 0}
    stats = StepStats()
    stats.add({"losses/policy": 0.5})
    grpo.rollout_stats(stats, samples, [1.0, 0.0], [1.0, 0.0], torch.tensor([1.1, 0.0]), counts)
    seconds = {"start": time.time() - 2.0, "rollout": 0.5, "weight_sync": 0.1}
    stats.mean(step_times(seconds, types.SimpleNamespace(waited=0.25, hidden=0.2), samples))
    metrics = stats.reduce(Accelerator(cpu=True))
    assert metrics["time/train"] == pytest.approx(metrics["time/step"] - 0.75, abs=1e-6)  # step - rollout - score
    assert sum(metrics[f"time/{k}"] for k in ("rollout", "score", "train")) == pytest.approx(metrics["time/step"])
    assert metrics["rollout/tokens_per_s"] == pytest.approx(4 / 0.5)
    assert (metrics["charts/completion_length"], metrics["charts/completion_length_max"]) == (2.0, 3.0)
    assert metrics["charts/truncated_frac"] == 0.5 and metrics["charts/no_answer_frac"] == 0.5
    assert metrics["charts/reward"] == pytest.approx(0.55) and metrics["charts/reward_timeouts"] == 2
    assert metrics["rollout/tail_frac"] == pytest.approx(1 - 2 / 3)  # 1 - median / max of the lengths (3, 1)
    assert metrics["losses/policy"] == 0.5 and "charts/reward_no_answer" not in metrics


def test_cuda_memory_figures_exclude_a_sleeping_engine(monkeypatch):
    """A vLLM engine asleep keeps its tensors allocated (sleep unmaps their pages only), so torch's CUDA counters
    include them: create_engine records what they grew by across the engine's start and sleep, and the trainer's
    figure is the allocator's peak less that. torch's CUDA counters and vLLM's LLM are stood in for here: the
    arithmetic is what is tested, on a machine without a GPU."""
    import vllm

    from plumbing.engine import create_engine
    from plumbing.run import RunArgs, peak_memory

    allocated = {"now": 3 * 2**30}  # the trainer's models, loaded before the engine

    class SleepingLLM:  # what torch counts for a vLLM engine: 40 GB at start, and still 40 GB once asleep
        def __init__(self, model, **kwargs):
            allocated["now"] += 40 * 2**30

        def sleep(self, level):
            pass

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "0")  # create_engine sets them for vLLM: they are restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["now"] + 5 * 2**30)  # a step's peak
    monkeypatch.setattr(vllm, "LLM", SleepingLLM)
    engine = create_engine(RunArgs(engine="vllm"), "model", 0, 64, [0])
    assert engine.asleep and engine.cuda_bytes == 40 * 2**30
    # 3 GB of models + the step's 5, not 48
    assert peak_memory(engine)["memory/cuda_allocated_gb_max"] == pytest.approx(8.0)


def test_real_models_do_not_inherit_toy_defaults(tmp_path):
    args = resolved(grpo)
    assert args.learning_rate == 5e-4 and args.max_new_tokens == 48 and args.answer_format == "answer_tags"
    real = resolved(grpo, model=str(tmp_path), task="gsm8k")
    assert real.learning_rate == 1e-6 and real.max_new_tokens == 1024 and real.answer_format == "boxed"
    assert resolved(grpo, model=str(tmp_path), learning_rate=3e-6).learning_rate == 3e-6
    shutil.copytree(grpo.TOY_MODEL_DIR, tmp_path / "trained_from_the_toy")  # e.g. runs/grpo__1/final: same shape
    trained = resolved(grpo, model=str(tmp_path / "trained_from_the_toy"))
    assert trained.learning_rate == 5e-4 and trained.max_new_tokens == 48


@pytest.mark.parametrize("overrides, message", [
    ({"temperature": 0.0}, "--temperature 0.0: must be > 0"),
    ({"num_generations": 0}, "--num_generations 0: must be > 0"),
    ({"num_generations": 1}, "groups of >= 2 completions are needed"),
    ({"prompts_per_step": 0}, "--prompts_per_step 0: must be > 0"),
    ({"micro_batch_size": 0}, "--micro_batch_size 0: must be > 0"),
    ({"num_minibatches": 0}, "--num_minibatches 0: must be > 0"),
    ({"learning_rate": -1.0}, "--learning_rate -1.0: must be > 0"),
    ({"max_new_tokens": 0}, "--max_new_tokens 0: must be > 0"),
    ({"total_steps": 0}, "--total_steps 0: must be >= 1"),
    ({"beta": -1.0}, "--beta, --clip_eps and --adv_eps must be >= 0"),
    ({"eval_size": 0}, "--eval_every 0 to skip evaluation"),
    ({"top_p": 0.0}, "must be in (0, 1]"),
    ({"model": "/no/such/model"}, "neither a local folder nor a hub id"),
    ({"model": "a/b/c"}, "neither a local folder nor a hub id"),
    ({"task": "gsm9k"}, "unknown task 'gsm9k'"),
    ({"micro_batch_size": 7}, "must divide into --num_minibatches"),
    ({"clip_eps": -0.1}, "--clip_eps and --adv_eps must be >= 0"),
    ({"tis_cap": 0.5}, "--tis_cap 0.5: must be > 1"),
    ({"malloc_mmap_threshold": -1}, "--malloc_mmap_threshold -1: must be >= 0"),
    ({"vllm_gpu_memory_utilization": 1.0}, "--vllm_gpu_memory_utilization 1.0: must be in (0, 1)"),
    ({"vllm_gpu_memory_utilization": 0.0}, "--vllm_gpu_memory_utilization 0.0: must be in (0, 1)"),
])
def test_every_bad_argument_is_caught_before_heavy_work(overrides, message):
    with pytest.raises(ValueError) as error:
        resolved(grpo, **overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert resolved(grpo, total_steps=0, eval_only=True).total_steps == 0  # eval-only trains nothing
    assert resolved(grpo, eval_size=0, eval_every=0).run.eval_size == 0


@pytest.mark.parametrize("flags, env, message", [  # one per kind of check; the rest are tested in process above
    (["--temperature", "0"], {}, "--temperature 0.0: must be > 0"),  # resolve_args
    (["--max_new_tokens", "1000"], {}, "exceeds the model's 1024 positions"),  # the model's config
    (["--resume"], {}, "has no checkpoint"),  # the run folder
    ([], {"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16 is not supported"),  # `accelerate launch --mixed_precision`
])
def test_bad_input_fails_in_one_line(tmp_path, flags, env, message, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    proc, _ = run_grpo(flags, tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_what_the_gpu_path_does_not_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """fp16 (no loss scaling), a GPU without bf16, expandable segments beside vLLM's sleep mode, and a mixture of
    experts pushed into vLLM: each a one-line error before any model loads. The GPU's properties are stood in for."""
    from transformers import Qwen2MoeConfig

    from plumbing.run import RunArgs, check_device, check_model_config

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="fp16 is not supported .*: launch with --mixed_precision bf16"):
        check_device(RunArgs())
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    check_device(RunArgs())  # a CPU: nothing else to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))  # a T4
    with pytest.raises(ValueError, match=r"compute capability 7.5\) has no bf16"):
        check_device(RunArgs())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments:True, which vLLM's sleep mode cannot use"):
        check_device(RunArgs(engine="vllm"))
    check_device(RunArgs(engine="hf"))  # the HF engine has no memory pool of its own
    Qwen2MoeConfig(num_experts=4, max_position_embeddings=256).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="a mixture-of-experts model.*: pass --engine hf"):
        check_model_config(str(tmp_path), RunArgs(engine="vllm"), 64, 64)
    check_model_config(str(tmp_path), RunArgs(engine="hf"), 64, 64)


def test_unknown_hub_model_offline_fails_fast(tmp_path):
    """A hub id that is not cached, with the hub unreachable: one line in seconds, not a minute of retries."""
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0")
    proc = subprocess.run([sys.executable, "grpo.py", "--model", "NoSuchOrg/no-such-model", "--output_dir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "not in the local cache" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]  # (the hub's
    # retries end with another message, after a minute)


@pytest.mark.slow
def test_one_process_off_policy_minibatches_checkpoint_and_eval_only(tmp_path):
    """mu = 4 updates per rollout: the first mini-batch is on-policy (ratio exactly 1), later ones are not."""
    proc, rows = run_grpo(["--total_steps", "3", "--num_epochs", "2", "--num_minibatches", "2", "--eval_every", "2",
                           "--save_every", "2", "--learning_rate", "3e-3", "--tis_cap", "2.0", "--tis_mode", "seq-mask",
                           *SMALL], tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["policy/first_minibatch_ratio_dev_max"] == 0.0
        assert r["rollout/logprob_gap_max"] < 1e-4  # HF generate samples from the trainer's own weights
        for key in ("charts/reward", "charts/accuracy", "charts/format", "charts/completion_length", "losses/kl",
                    "losses/entropy", "policy/clip_frac", "policy/tis_bounded_frac", "time/rollout", "time/score",
                    "time/train", "time/step"):
            assert np.isfinite(r[key]), key
        assert r["time/rollout"] + r["time/score"] + r["time/train"] == pytest.approx(r["time/step"])
    assert max(r["policy/ratio_max"] for r in rows) > 1.0  # later mini-batches are off-policy
    assert "eval/pass@1_greedy" in rows[1] and "eval/pass@1_sampled_k2" in rows[2]
    assert 1 >= rows[2]["eval/pass@2"] >= rows[2]["eval/pass@1_sampled_k2"]  # from the same 2 samples per problem
    run_dir = tmp_path / "grpo__1"
    assert (run_dir / "checkpoint" / "step.json").exists() and (run_dir / "final" / "model.safetensors").exists()
    assert not (run_dir / "checkpoint.tmp").exists()
    assert "[gold" in proc.stdout and "'07+45=' ->" not in proc.stdout  # samples show their prompt, gold, reward
    assert proc.stdout.count("step 3/3 ") == 1
    noise = proc.stdout + proc.stderr
    assert "Removed shared tensor" not in noise and "Loading weights" not in noise
    assert not (run_dir / "checkpoint" / "model_1.safetensors").exists()  # the frozen reference is not saved
    assert (run_dir / "checkpoint" / "model.safetensors").exists()
    # the eval-only command of docs/running.md on the run's own folder: results go to eval_only.jsonl, metrics stay as
    # they were
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    proc, _ = run_grpo(["--model", str(run_dir / "final"), "--eval_only", "--eval_size", "16", "--eval_samples", "2",
                        "--max_new_tokens", "48", "--max_prompt_length", "64"], tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/problems"] == 16 and 0 <= result["eval/pass@1_greedy"] <= 1
    assert json.loads((run_dir / "eval_only.jsonl").read_text())["eval/problems"] == 16
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    # ... and the run still resumes (it crashed on the eval row before)
    _, rows = run_grpo(["--total_steps", "4", "--num_epochs", "2", "--num_minibatches", "2", "--eval_every", "0",
                        "--resume", *SMALL], tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    """A NaN injected into the advantages of step 3: exit with one line naming the step, before the optimizer step;
    the step-2 checkpoint is intact and no final/ is written."""
    from safetensors.torch import load_file

    inject = ("import sys, torch, tyro, grpo; sys.argv = sys.argv[1:]; real = grpo.compute_advantages; calls = []\n"
              "def nan_at_step_3(*a, **k):\n"
              "    calls.append(1); adv = real(*a, **k)\n"
              "    return adv * float('nan') if len(calls) == 3 else adv\n"
              "grpo.compute_advantages = nan_at_step_3; grpo.main(tyro.cli(grpo.Args))")
    proc, rows = run_grpo(["--total_steps", "4", "--save_every", "1", "--eval_every", "0", *SMALL], tmp_path,
                          launcher=(sys.executable, "-c", inject), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 3: non-finite gradient norm") and "last checkpoint" in last, last
    run_dir = tmp_path / "grpo__1"
    assert json.loads((run_dir / "checkpoint" / "step.json").read_text())["step"] == 2
    weights = load_file(run_dir / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (run_dir / "final").exists() and [r["step"] for r in rows] == [1, 2]


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(tmp_path):
    """A resumed run continues as if uninterrupted, here with gradient checkpointing on (its wrapped layers save and
    load under the model's own names)."""
    SMALL = [*tests.helpers.SMALL, "--gradient_checkpointing", "on"]  # noqa: N806
    _, rows = run_grpo(["--total_steps", "2", "--save_every", "2", "--eval_every", "0", *SMALL], tmp_path)
    assert len(rows) == 2
    proc, _ = run_grpo(["--total_steps", "4", "--eval_every", "0", *SMALL], tmp_path, check=False)
    assert proc.returncode != 0 and "pass --resume" in proc.stderr  # never overwrite a checkpoint silently
    with open(tmp_path / "grpo__1" / "metrics.jsonl", "a") as f:  # a crash after step 2's checkpoint logged step 3
        f.write(json.dumps({"step": 3, "charts/reward": -1.0}) + "\n")
    proc, rows = run_grpo(["--total_steps", "4", "--eval_every", "0", "--resume", *SMALL], tmp_path)
    assert "resumed from" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3, 4]
    # the same run without the interruption gives the same steps 3 and 4: model, optimizer and RNG were restored
    _, straight = run_grpo(["--total_steps", "4", "--save_every", "2", "--eval_every", "0", "--exp_name", "straight",
                            *SMALL], tmp_path)
    for key in ("charts/reward", "charts/completion_length", "losses/policy", "policy/grad_norm"):
        assert [r[key] for r in rows[2:]] == pytest.approx([r[key] for r in straight[2:]], rel=1e-5), key
    step = json.load(open(tmp_path / "grpo__1" / "checkpoint" / "step.json"))["step"]
    assert step == 4


@pytest.mark.slow
def test_two_processes(tmp_path):
    """Two gloo processes: groups stay whole on each rank, normalizers and eval counts are global. accelerate's
    --multi_gpu launcher (torchrun) is what starts several CPU processes; `accelerate launch --cpu` starts one."""
    launcher = two_processes(29533)
    proc, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", "--num_minibatches", "2", *SMALL,
                           "--micro_batch_size", "4"], tmp_path, launcher=launcher)
    assert proc.stdout.count("task toy:") == 1 and "2 process(es)" in proc.stdout  # one main process prints
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["policy/first_minibatch_ratio_dev_max"] == 0.0
    assert rows[1]["eval/problems"] == 16  # both ranks' halves of the eval set were counted


@pytest.mark.slow
def test_mixed_precision_bf16_on_one_cpu_process(tmp_path):
    """--mixed_precision bf16 in a plain run: the model computes in bf16 (the engine/trainer gap of a bf16 trainer,
    far above float32's)."""
    _, float32 = run_grpo(["--total_steps", "1", "--eval_every", "0", *SMALL, "--exp_name", "f32"], tmp_path)
    _, bf16 = run_grpo(["--total_steps", "1", "--eval_every", "0", *SMALL, "--mixed_precision", "bf16"], tmp_path)
    assert float32[0]["rollout/logprob_gap_mean"] < 1e-5 < bf16[0]["rollout/logprob_gap_mean"] < 0.1


@pytest.mark.slow
def test_local_math_shaped_file_with_the_embedded_model(tmp_path):
    """A MATH-shaped file whose golds are LaTeX (\\frac{104}{2} for 07+45=): the toy model's <answer>052</answer> is
    only right through math-verify, so the warm reward workers do the scoring inside the loop."""
    path = tmp_path / "math.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a, b = (i * 37) % 100, (i * 53 + 11) % 100
            solution = f"$\\boxed{{\\frac{{{2 * (a + b)}}}{{2}}}}$"
            f.write(json.dumps({"problem": f"{a:02d}+{b:02d}=", "solution": solution}) + "\n")
    proc, rows = run_grpo(["--task", str(path), "--total_steps", "2", "--eval_every", "2", "--answer_format",
                           "answer_tags", *SMALL], tmp_path)
    assert "36 train / 4 test prompts" in proc.stdout
    assert len(rows) == 2 and rows[1]["eval/problems"] == 4
    assert max(r["charts/accuracy"] for r in rows) > 0  # scored by math-verify in the workers
    for key in ("charts/reward_timeouts", "charts/reward_verify_timeouts", "charts/reward_errors",
                "charts/reward_memory", "charts/reward_unparsed"):
        assert rows[0][key] == 0, key
    assert "time/score" in rows[0] and "time/score_hidden" in rows[0]


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """The README's main job, `python grpo.py`, its first 80 of 200 steps (the learning rate is constant: the same
    steps): the mean reward of steps 76-80 beats steps 1-5 by >= 0.2 (`python grpo.py --eval_every 0 --total_steps
    80 --seed S` gained 0.270, 0.295, 0.292 for seeds 1-3 on an AVX-512 machine)."""
    _, rows = run_grpo(["--eval_every", "0", "--total_steps", "80"], tmp_path, timeout=900)
    rewards = [r["charts/reward"] for r in rows]
    assert len(rewards) == 80
    assert np.mean(rewards[-5:]) - np.mean(rewards[:5]) >= 0.2, (rewards[:5], rewards[-5:])


def test_a_crash_while_checkpointing_loses_nothing(tmp_path, monkeypatch):
    """save_checkpoint writes checkpoint.tmp (step.json last), then renames checkpoint -> .old and .tmp -> checkpoint.
    A crash inside a save, or between the two renames, leaves the previous checkpoint whole: resuming restores its
    step and weights, and the next save completes."""
    from tests.test_engine import setup
    from plumbing import run as runs

    _, accelerator, tokenizer, model = setup()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    run_dir = str(tmp_path)
    runs.save_checkpoint(accelerator, model, tokenizer, run_dir, step=2)

    def crash_inside_the_save(*args, **kwargs):
        raise OSError("disk full")

    def crash_at_the_swap(src, dst, replace=os.replace):
        if dst == os.path.join(run_dir, "checkpoint"):  # after checkpoint -> checkpoint.old
            raise OSError("killed")
        replace(src, dst)

    for target, name, crash, left in ((runs, "save_model", crash_inside_the_save, "checkpoint"),
                                      (runs.os, "replace", crash_at_the_swap, "checkpoint.old")):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training went on after the checkpoint
        with monkeypatch.context() as patch:
            patch.setattr(target, name, crash)
            with pytest.raises(OSError):
                runs.save_checkpoint(accelerator, model, tokenizer, run_dir, step=4)
        assert find_checkpoint(run_dir) == os.path.join(run_dir, left)
        assert runs.load_checkpoint(accelerator, find_checkpoint(run_dir)) == 3  # step 2's: step 3 runs next
        for key, p in model.named_parameters():
            assert torch.equal(p, saved[key]), (name, key)
    runs.save_checkpoint(accelerator, model, tokenizer, run_dir, step=6)  # after a crash at the swap, a save completes
    assert find_checkpoint(run_dir) == os.path.join(run_dir, "checkpoint")
    assert sorted(os.listdir(run_dir)) == ["checkpoint"]
