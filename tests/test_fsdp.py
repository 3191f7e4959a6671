"""FSDP2 on 2 CPU processes (gloo), launched as on GPUs: `accelerate launch --config_file configs/fsdp2.yaml` (with
--mixed_precision no). plumbing/parallel.py's make_accelerator turns accelerate's FSDP2 on for CPU processes (accelerate
1.15 otherwise falls back to DDP there), so every line after it is the GPU run's: the policy and the reference model
sharded (DTensor parameters), the gradient norm gathered, the weights gathered for the engine one tensor at a time,
sharded checkpoints and an exact resume, and a final/ folder of full weights. A 2-process FSDP2 run's metrics equal a
2-process DDP run's with the same seed to float32 rounding (rel 1e-4: the gradient is reduce-scattered in shards
instead of all-reduced whole, and each micro-batch's gradient reduced on its own, so sums run in another order)."""

import json
import os
import subprocess

import pytest

from tests.helpers import ROOT, SMALL, fsdp2, run_grpo, two_processes

pytestmark = pytest.mark.slow  # each test launches 2 processes


SHARDING_CHECK = """
import json, torch
from torch.distributed.tensor import DTensor
import grpo
from tests.helpers import resolved
from plumbing.models import load_model, load_tokenizer
from plumbing.parallel import load_models, make_accelerator, policy_weights

args = resolved(grpo)
accelerator = make_accelerator()
tokenizer, _ = load_tokenizer(args.model)
model, optimizer, ref_model = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator, True)
weights = list(policy_weights(model, accelerator))  # every rank gathers every tensor, in the same order
plain = load_model(args.model, tokenizer).state_dict()
result = {"type": str(accelerator.distributed_type),
          "policy_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
          "reference_sharded": all(isinstance(p, DTensor) for p in ref_model.parameters()),
          "local_rows": [p.to_local().shape[0] for p in ref_model.parameters()][:1],
          "names": [name for name, _ in weights] == list(plain),
          "full": all(torch.equal(t, plain[name]) for name, t in weights)}
if accelerator.is_main_process:
    print(json.dumps(result))
"""


def test_the_policy_and_the_reference_are_sharded_and_gathered_whole(tmp_path):
    """The reference model is sharded on the policy's mesh (accelerate's prepare_model for evaluation would leave a
    full copy on the CPU, and on a GPU the first reference pass would fail on the device), and the weights the engine
    gets are the full tensors under the model's own names."""
    script = tmp_path / "sharding_check.py"
    script.write_text(SHARDING_CHECK)
    proc = subprocess.run([*fsdp2(29551), str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["type"].endswith("FSDP") and result["policy_sharded"] and result["reference_sharded"], result
    assert result["local_rows"] == [129] and result["names"] and result["full"], result  # 258 rows of embeddings / 2


def test_grpo_fsdp2_equals_ddp_resumes_exactly_and_saves_full_weights(tmp_path):
    """The same 3 steps under DDP and under FSDP2 (2 mini-batches of 2 micro-batches each: FSDP2 reduce-scatters
    each micro-batch's gradient where DDP accumulates and all-reduces once; the KL term on: the reference model too);
    the FSDP2 run stopped after its sharded step-2 checkpoint and resumed gives an uninterrupted FSDP2 run's metrics
    exactly. Groups stay whole on each rank, normalizers and eval counts are global."""
    flags = ["--num_minibatches", "2", *SMALL, "--micro_batch_size", "2"]
    proc, ddp = run_grpo(["--total_steps", "3", "--eval_every", "3", "--exp_name", "ddp", *flags], tmp_path,
                         launcher=two_processes(29552))
    assert proc.stdout.count("task toy:") == 1 and "2 process(es)" in proc.stdout  # one main process prints
    assert ddp[0]["policy/first_minibatch_ratio_dev_max"] == 0.0 and ddp[2]["eval/problems"] == 16
    # (no evaluation before the checkpoint: it samples, so it would move the random state the checkpoint saves)
    run_grpo(["--total_steps", "2", "--save_every", "2", "--eval_every", "0", "--exp_name", "fsdp", *flags], tmp_path,
             launcher=fsdp2(29553))
    checkpoint = tmp_path / "fsdp__1" / "checkpoint"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir()  # each rank's shards, not one gathered file
    proc, fsdp = run_grpo(["--total_steps", "3", "--eval_every", "3", "--resume", "--exp_name", "fsdp", *flags],
                          tmp_path, launcher=fsdp2(29554))
    assert "resumed from" in proc.stdout and [r["step"] for r in fsdp] == [1, 2, 3]
    for key in ("charts/reward", "charts/completion_length", "losses/policy", "losses/kl", "policy/grad_norm",
                "policy/clip_frac"):
        assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in ddp], rel=1e-4, abs=1e-7), key
    assert fsdp[2]["eval/pass@1_greedy"] == pytest.approx(ddp[2]["eval/pass@1_greedy"])
    _, straight = run_grpo(["--total_steps", "3", "--eval_every", "3", "--exp_name", "fsdp_straight", *flags],
                           tmp_path, launcher=fsdp2(29558))
    for key in ("charts/reward", "losses/policy", "losses/kl", "policy/grad_norm", "eval/pass@1_greedy"):
        assert [r.get(key) for r in fsdp] == [r.get(key) for r in straight], key  # the same computation: exact
    from safetensors.torch import load_file

    final = load_file(str(tmp_path / "fsdp__1" / "final" / "model.safetensors"))  # full tensors, loadable as --model
    assert final["model.embed_tokens.weight"].shape[0] == 258


def test_ppo_and_grpo_async_under_fsdp2(tmp_path):
    """ppo.py's critic is sharded and checkpointed beside the policy; grpo_async.py's ranks decide together whether
    to generate (a rank whose groups are all complete still joins the engine's collective passes: otherwise the
    other rank waits forever, and the run hits the timeout)."""
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "0", "--save_every", "2", "--prompts_per_step", "8",
                        "--micro_batch_size", "2"], tmp_path, launcher=fsdp2(29555), script="ppo.py", timeout=600)
    assert [r["step"] for r in rows] == [1, 2] and all(r["critic/value_loss"] >= 0 for r in rows)
    assert (tmp_path / "ppo__1" / "checkpoint" / "pytorch_model_fsdp_1").is_dir()  # the critic's shards
    _, rows = run_grpo(["--total_steps", "4", "--eval_every", "0", "--overprovision", "3", *SMALL,
                        "--micro_batch_size", "4"], tmp_path, launcher=fsdp2(29556), script="grpo_async.py",
                       timeout=600)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and any(r["async/groups_carried"] > 0 for r in rows)


def test_a_lora_run_under_fsdp2_checkpoints_its_adapters_alone_and_resumes_exactly(tmp_path):
    """accelerate saves an FSDP model's shards itself (the save hook that filters a LoRA checkpoint sees no weights):
    plumbing/lora.py's trained_shards keeps the frozen base out of the checkpoint, and the resumed run is the
    uninterrupted one, with gradient checkpointing's wrappers too (whose adapters peft's adapter state dict, what
    accelerate's adapter-only mode loads, leaves as they were)."""
    import torch.distributed.checkpoint as dcp

    flags = ["--eval_every", "0", "--save_every", "2", "--lora_rank", "4", "--learning_rate", "1e-3", *SMALL,
             "--micro_batch_size", "4", "--gradient_checkpointing", "on"]
    run_grpo(["--total_steps", "2", "--exp_name", "lora", *flags], tmp_path, launcher=fsdp2(29559))
    saved = dcp.FileSystemReader(str(tmp_path / "lora__1" / "checkpoint" / "pytorch_model_fsdp_0")).read_metadata()
    keys = [key.removeprefix("model.") for key in saved.state_dict_metadata]
    assert keys and all("lora_" in key for key in keys), keys[:5]
    _, resumed = run_grpo(["--total_steps", "3", "--resume", "--exp_name", "lora", *flags], tmp_path,
                          launcher=fsdp2(29560))
    _, straight = run_grpo(["--total_steps", "3", "--exp_name", "straight", *flags], tmp_path, launcher=fsdp2(29561))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("charts/reward", "losses/policy", "losses/kl", "policy/grad_norm"):
        assert resumed[2][key] == straight[2][key], key  # the same computation: exact


PRECISION_CHECK = """
import json, torch
import grpo
from tests.helpers import resolved
from plumbing.engine import Sample
from plumbing.models import load_tokenizer
from plumbing.parallel import load_models, make_accelerator

args = resolved(grpo)
accelerator = make_accelerator()
tokenizer, _ = load_tokenizer(args.model)
model, optimizer, _ = load_models(args.model, args.learning_rate, args.run, tokenizer, accelerator, False)
batch = grpo.make_batch([[5, 6, 7]] * 2, [Sample([8, 9, 2], [-1.0] * 3, False)] * 2, tokenizer.pad_token_id,
                        accelerator.device)
seen = []
layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
layer.register_forward_hook(lambda module, inputs, output: seen.append(str(output.dtype)))
logp, _ = grpo.token_logprobs(model, batch, 1.0, accelerator)
accelerator.backward(-logp.sum())
policy = accelerator.state.fsdp_plugin.mixed_precision_policy if accelerator.is_fsdp2 else None
result = {"precision": accelerator.mixed_precision, "type": str(accelerator.distributed_type),
          "policy": None if policy is None else [str(policy.param_dtype), str(policy.reduce_dtype)],
          "weights": sorted({str(p.dtype) for p in model.parameters()}),
          "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
          "layer_output": sorted(set(seen)), "logp": str(logp.dtype)}
if accelerator.is_main_process:
    print(json.dumps(result))
"""


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_the_gpu_runs_bf16_path_on_cpu_processes(tmp_path, parallel):
    """`--mixed_precision bf16`, as the GPU configs launch: torch autocasts to bf16 on CPUs too, and gloo carries
    FSDP2's bf16 all-gathers and its float32 gradient reduce-scatters. The weights and their gradients stay float32, the
    layers compute in bf16 (FSDP2: the MixedPrecisionPolicy make_accelerator sets, reducing in float32, where
    accelerate's own reduces in bf16), the log-probs come out float32; a 2-step run on that path trains, its
    engine/trainer gap that of a bf16 trainer (above float32's ~1e-7, under --logprob_gap_warn)."""
    launcher = list(fsdp2(29562) if parallel == "fsdp2" else two_processes(29563))
    launcher[launcher.index("--mixed_precision") + 1] = "bf16"
    script = tmp_path / "precision_check.py"
    script.write_text(PRECISION_CHECK)
    proc = subprocess.run([*launcher, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["precision"] == "bf16" and result["weights"] == result["grads"] == ["torch.float32"], result
    assert result["layer_output"] == ["torch.bfloat16"] and result["logp"] == "torch.float32", result
    assert result["policy"] == (["torch.bfloat16", "torch.float32"] if parallel == "fsdp2" else None), result
    _, rows = run_grpo(["--total_steps", "2", "--eval_every", "2", *SMALL, "--micro_batch_size", "4"], tmp_path,
                       launcher=launcher)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval/pass@1_greedy"] >= 0
    for r in rows:
        assert 1e-5 < r["rollout/logprob_gap_mean"] < 0.1 and r["policy/grad_norm"] > 0
