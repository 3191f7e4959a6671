"""The algorithm scripts are copies of grpo.py (cleanrl style): every block under a `# ---- Name ----` header that does
not depend on the algorithm must be the same text in every script, so a fix to a shared block is made in all of them
or in none; so must every Args field outside the algorithm's own group (its default and its doc; the flags of the run's
plumbing are one dataclass, plumbing/run.py RunArgs, every Args's last field). What may differ is listed here, with
the scripts where it may. The scripts are the repository root's .py files with block headers."""

import dataclasses
import glob
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = re.compile(r"^# ---- (.+?) -+$", re.MULTILINE)
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")) if HEADER.search(open(p).read()))
ARGS_GROUP = re.compile(r"^    # (.+)$", re.MULTILINE)  # `    # rollout`: a group of Args fields
# a field and its doc
ARGS_FIELD = re.compile(r"^    (\w+): .*\n(?:    \"\"\"(?:[^\"]|\"(?!\"\"))*\"\"\"\n)?", re.MULTILINE)
ENGINE = "Rollout: vLLM (colocated, sleep mode on GPU) or the HF decode loop"
RUN_SETUP = "Run setup (infrastructure: skip on a first read)"
EVALUATION = "Evaluation (infrastructure: skip on a first read)"
ALGORITHM_SPECIFIC = {  # block name -> the scripts where it may differ from the others ("*": every script)
    "Algorithm": "*",
    RUN_SETUP: ("grpo_tools.py",  # the embedded model's default leaves room for a tool call
                "empg.py",  # grpo_tools.py's
                "calibrated.py",  # the embedded model's default leaves room for the probability it states
                "sft.py",  # one target per prompt (gold) or G samples (rft); the RL scripts' run flags refused
                "dpo.py",  # two completions per prompt (its pair); the rollout page refused
                "opd.py"),  # the teacher resolved, its vocabulary checked; the rollout page refused
    "Rollout batch": ("high_entropy.py",  # + pi_old's entropies
                      "dpo.py",  # + pair_micro_batches: a pair's two completions in one pass
                      "grpo_async.py",  # + the tokens this step's weights sampled
                      "ppo.py"),  # + the critic's values and returns
    "Token log-probs": ("high_entropy.py",  # pi_old's entropies with its log-probs, before the update
                        "empg.py",  # the same as high_entropy.py's
                        "opd.py"),  # + the divergence of the two output layers over the same chunks
    ENGINE: ("grpo_async.py",  # + generate_partial: generation that stops once enough groups are complete
             "grpo_tools.py",  # sample() for generate(): a turn stops at the tool call; the context holds tool output
             "empg.py"),  # grpo_tools.py's
    EVALUATION: ("grpo_tools.py",  # test completions may call the tool too; the KL over the model's own tokens
                 "empg.py"),  # grpo_tools.py's
    "Policy update": ("sft.py",  # the negative log-likelihood of the fitted targets, mini-batches without any skipped
                      "dpo.py",  # the pairs' loss, TRL's metrics; no importance weights, no ratio
                      "opd.py",  # the teacher's divergence per token; no advantages, no ratio
                      "ppo.py",  # the critic's value-loss step beside the policy's, on the same mini-batches
                      "high_entropy.py",  # the mini-batch's entropy threshold masks the policy gradient
                      "clip_cov.py",  # --tis_cap's weights go to the loss apart from A: the selection ranks A alone
                      "grpo_async.py"),  # the engine/trainer gap over this step's tokens only
    "Training loop": ("sft.py",  # targets (gold answers or the policy's correct samples) instead of advantages
                      "dpo.py",  # pairs from a file, an offline pool or the current policy, instead of advantages
                      "opd.py",  # the teacher loaded and passed to the update; the reward logged only
                      "reinforce_pp.py",  # per-token returns, whitened over the batch; the KL in the reward
                      "ppo.py",  # the critic: its values, per-token rewards, GAE
                      "dapo.py",  # dynamic sampling: generation rounds until enough groups have distinct rewards
                      "gdpo.py",  # the advantage takes the reward's parts, not their sum
                      "grpo_kl.py",  # k1 in the reward: pi_old before the update, the KL paid from the rewards
                      "high_entropy.py",  # pi_old's entropies before every update
                      "grpo_async.py",  # the carried groups: rollout, staleness metrics, checkpointed carry-over
                      "grpo_tools.py",  # multi-turn rollouts with the sandbox, tool output masked, tool metrics
                      "empg.py",  # grpo_tools.py's, with pi_old's entropies before the update modulating A per turn
                      "calibrated.py"),  # the reward of the stated probabilities; the prompt asks for one
}
FUNCTIONS_THAT_DIFFER = {  # (script, function) of a shared name whose text may differ in a block declared different
    ("grpo_tools.py", "resolve_args"),  # the embedded model's default leaves room for a tool call
    ("calibrated.py", "resolve_args"),  # the embedded model's default leaves room for the stated probability
    ("grpo_tools.py", "start_evaluation"),  # evaluation through rollout() with the tool; the KL's masks
    ("empg.py", "resolve_args"),  # grpo_tools.py's
    ("empg.py", "start_evaluation"),  # grpo_tools.py's
    ("sft.py", "resolve_args"),  # its own learning-rate default, a group of 1 with gold targets, flags refused
    ("dpo.py", "resolve_args"),  # two sequences per prompt, an even micro-batch, the page refused
    ("opd.py", "resolve_args"),  # the teacher's file and vocabulary, the page refused
    ("high_entropy.py", "batched_logprobs"),  # with_entropy: pi_old's entropies from the same pass as its log-probs
    ("empg.py", "batched_logprobs"),  # high_entropy.py's
}
ALGORITHM_SPECIFIC_ARGS = {  # Args fields of the shared groups that may differ, and where (the algorithm's own group,
    "model": ("grpo_tools.py", "empg.py",  # e.g. `# GRPO`, always may): the embedded model warmed up to call the tool
              "calibrated.py"),  # the embedded model taught to state a probability (RL cannot reward an unsampled form)
    "task": ("grpo_tools.py", "empg.py"),  # toy_mul: products it cannot compute in its head
    "max_new_tokens": ("grpo_tools.py", "empg.py",  # the model's tokens over all turns; room for a tool call on the toy
                       "calibrated.py"),  # room for the stated probability on the toy
    "num_epochs": ("ppo.py", "sft.py", "dpo.py"),  # each paper's off-policy regime: mu = num_epochs *
    "num_minibatches": "*",  # num_minibatches (sft.py, dpo.py: passes over targets or pairs, not a rollout batch)
    "tis_cap": ("grpo_async.py",),  # on by default: it is the staleness correction
    "beta": ("grpo_kl.py",),  # the KL's estimator and place are its --kl_estimator
    "top_p": ("sft.py", "dpo.py", "opd.py"),  # these docs speak of targets, pairs and distillation, not of rollouts
    # and policy gradients
    "total_steps": ("sft.py", "dpo.py"),
    "micro_batch_size": ("sft.py", "dpo.py"),
    "prompts_per_step": ("ppo.py", "dpo.py"),  # ppo.py: no groups, more distinct prompts; dpo.py: a pair each
    "temperature": ("dpo.py", "opd.py"),  # dpo.py: the loss takes log pi at 1; opd.py: both models' logits
}


def blocks(text):
    """{block name: text from its header to the next header}; the docstring, imports and Args come before the first."""
    headers = list(HEADER.finditer(text))
    return {m.group(1): text[m.end():headers[k + 1].start() if k + 1 < len(headers) else len(text)]
            for k, m in enumerate(headers)}


def args_fields(text):
    """{group: {field: its line and doc}} of a script's Args, grouped under their `    # group` comments."""
    body = text[text.index("class Args"):text.index("\n\n\n", text.index("class Args")) + 1]  # the last doc's newline
    groups = list(ARGS_GROUP.finditer(body))
    return {m.group(1): {field.group(1): field.group(0) for field in ARGS_FIELD.finditer(
        body, m.end(), groups[k + 1].start() if k + 1 < len(groups) else len(body))} for k, m in enumerate(groups)}


def differences(texts, allowed):
    """[(block, scripts whose text differs from the most common one)] over blocks that several scripts share."""
    found = []
    for name in sorted({name for by_block in texts.values() for name in by_block}):
        if allowed.get(name) == "*":
            continue
        versions = {script: by_block[name] for script, by_block in texts.items()
                    if name in by_block and script not in allowed.get(name, ())}
        if len(versions) < 2:
            continue
        common = max(set(versions.values()), key=list(versions.values()).count)
        odd = sorted(script for script, text in versions.items() if text != common)
        if odd:
            found.append((name, odd))
    return found


def test_the_scripts_have_the_template_blocks():
    assert "grpo.py" in SCRIPTS
    names = list(blocks(open(os.path.join(ROOT, "grpo.py")).read()))
    assert {"Algorithm", ENGINE, "Rollout batch", "Token log-probs", "Policy update", "Training loop", RUN_SETUP,
            EVALUATION} <= set(names), names


def test_shared_blocks_are_identical_in_every_script():
    texts = {script: blocks(open(os.path.join(ROOT, script)).read()) for script in SCRIPTS}
    for script, by_block in texts.items():
        assert by_block, f"{script} has no '# ---- Name ----' blocks"
    found = differences(texts, ALGORITHM_SPECIFIC)
    assert not found, "; ".join(f"block '{name}' differs in {', '.join(odd)} (fix it in every script, or declare it "
                                f"algorithm-specific in tests/test_shared_blocks.py)" for name, odd in found)


def test_functions_of_a_block_that_may_differ_are_identical_where_they_share_a_name():
    """A block declared different may add or replace functions; a function of the same name is still one text
    (grpo_async.py's engine block adds generate_partial beside grpo.py's generate, which must stay grpo.py's)."""
    function = re.compile(r"^def (\w+)\(.*?(?=^(?:@[^\n]*\n)*(?:def|class) |\Z)", re.MULTILINE | re.DOTALL)
    for name, scripts in ALGORITHM_SPECIFIC.items():
        if scripts == "*":
            continue
        texts = {script: {m.group(1): m.group(0).rstrip() for m in function.finditer(blocks(
            open(os.path.join(ROOT, script)).read()).get(name, ""))} for script in SCRIPTS}
        compared = 0
        for script in scripts:
            for func, text in texts[script].items():
                if func in texts["grpo.py"] and func not in ("main", "evaluate", "update_policy") and (
                        script, func) not in FUNCTIONS_THAT_DIFFER:
                    assert text == texts["grpo.py"][func], f"{script}: {func}() differs from grpo.py's"
                    compared += 1
        if name == ENGINE:
            assert compared >= 1, compared  # grpo_async.py's generate


def test_shared_args_fields_are_identical_in_every_script():
    """Outside the algorithm's own group (`# GRPO`, `# DAPO`, ...: one script's), a field's default and doc are the
    same everywhere: the same flag means the same thing in every script."""
    fields = {script: {f"{group}: {name}": text for group, by_field in args_fields(open(os.path.join(ROOT, script))
                                                                                     .read()).items()
                       for name, text in by_field.items()} for script in SCRIPTS}
    assert len(fields["grpo.py"]) >= 25 and "rollout: temperature" in fields["grpo.py"]
    assert '"""sampling temperature' in fields["grpo.py"]["rollout: temperature"]  # the doc is part of the field
    allowed = {key: scripts for script in SCRIPTS for key in fields[script]
               for name, scripts in ALGORITHM_SPECIFIC_ARGS.items() if key.endswith(f": {name}")}
    found = differences(fields, allowed)
    assert not found, "; ".join(f"Args field '{key}' differs in {', '.join(odd)}" for key, odd in found)


def test_every_script_has_the_run_flags_last_and_redefines_none():
    """RunArgs (plumbing/run.py) holds the run's plumbing, the same in every script: each Args has it as its last field,
    `run`, and no field of its own with one of its names (the same flag would have two meanings)."""
    from plumbing.run import RunArgs

    shared = {field.name for field in dataclasses.fields(RunArgs)}
    for script in SCRIPTS:
        module = importlib.import_module(script[:-3])
        fields = dataclasses.fields(module.Args)
        assert fields[-1].name == "run" and fields[-1].default_factory is RunArgs, script
        redefined = shared & {field.name for field in fields}
        assert not redefined, f"{script} redefines {sorted(redefined)}: change them in plumbing/run.py RunArgs"


def test_a_one_line_change_is_caught():
    text = open(os.path.join(ROOT, "grpo.py")).read()
    changed = text.replace("def generate(", "def generate(  ", 1)
    texts = {"grpo.py": blocks(text), "copy_a.py": blocks(text), "copy_b.py": blocks(changed)}
    assert differences(texts, ALGORITHM_SPECIFIC) == [(ENGINE, ["copy_b.py"])]
    assert differences(texts, {**ALGORITHM_SPECIFIC, ENGINE: ("copy_b.py",)}) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_its_docstring(script):
    """Every Args field of every script, and every RunArgs field, is followed by its docstring (tyro's --help text for
    the flag: `python grpo.py --help` itself runs in tests/test_grpo_e2e.py); a field without one fails here."""
    import ast

    def undocumented(path, class_name):
        tree = ast.parse(open(path).read())
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name).body
        return [node.target.id for node, after in zip(body, body[1:] + [None]) if isinstance(node, ast.AnnAssign)
                and not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                         and isinstance(after.value.value, str) and after.value.value.strip())]

    assert open(os.path.join(ROOT, script)).read().rstrip().endswith("main(tyro.cli(Args))")
    assert undocumented(os.path.join(ROOT, script), "Args") == [], script
    assert undocumented(os.path.join(ROOT, "plumbing", "run.py"), "RunArgs") == []


def test_the_code_keeps_its_layout():
    """Every .py file of the repository: lines of at most 120 characters, and at most two blank lines in a row."""
    paths = [p for folder in ("", "plumbing", "utils", "tests", "benchmarks", "toy_model")
             for p in glob.glob(os.path.join(ROOT, folder, "*.py"))]
    assert len(paths) > 60
    for path in paths:
        text = open(path).read()
        long = [i + 1 for i, line in enumerate(text.split("\n")) if len(line) > 120]
        assert not long and "\n\n\n\n" not in text, (os.path.relpath(path, ROOT), long)
