"""--self_check: run this configuration for a few steps, on this machine, and check what must hold wherever it runs.

A script is checked by running it: its command line (the run's own flags, in a temporary folder) and its outputs
(metrics.jsonl, args.json, the checkpoint, the exit status, what it prints), never by importing, calling or patching
its functions, so a copied and renamed script is checked the same way. The checks (each PASS, FAIL or SKIP with its
numbers; the exit code is 1 when one fails):
- on-policy start: at step 1 the first mini-batch's ratio pi_theta / pi_old is 1, and when every ratio of the step
  was exactly 1 (the policy had not moved) and the loss has a KL term, the KL to the reference is 0 (the reference is
  the policy);
- engine/trainer agreement: every step's mean log-prob gap after the weight push is under a bound: 1e-3 for a float32
  engine (a CPU), --logprob_gap_warn for a bf16 one (a GPU);
- stale-weights alarm: a run whose weight push is broken on purpose (the environment variable
  plumbing.parallel.BREAK_PUSH_VARIABLE: the pushed weights carry noise as large as them) is stopped by the same
  measure, above --logprob_gap_stop (vLLM engines: the HF decode loop samples from the trainer's own weights);
- sleep (GPU sleep mode): step 2 samples from weights that slept through step 1's evaluation (level 1: kept, not
  pushed again; level 2: dropped and pushed again), and its gap is under the same bound;
- resume: a run stopped after step 1 and resumed gives step 2's metrics as an uninterrupted run;
- reward: the gold answers of a few training rows, written in the asked-for form, score full accuracy; empty answers,
  the gold written twice over (another answer) and hedged ones (the gold and another answer) score none.
Every run evaluates after each step on one test problem per process (so that step 2 follows a sleep). The runs go to
a temporary folder; the run's own folder gets only the report, self_check.md. Under `accelerate launch` (one node)
the first process runs the check and the others end at once; its runs are launched as this one was: torchrun with as
many processes, and the launch's configuration (accelerate passes it to the script in ACCELERATE_* and FSDP_*
variables: the precision, FSDP2 and its settings) inherited, the rank variables not.
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

from plumbing.parallel import BREAK_PUSH_VARIABLE, free_port

COMPARED = ("charts/reward", "charts/completion_length", "losses/policy", "losses/sft", "losses/dpo",
            "policy/grad_norm")  # those a script logs
OWN_FLAGS = ("--output_dir", "--output-dir", "--exp_name", "--exp-name")  # the check's own, with a value
DROPPED = ("--self_check", "--self-check", "--resume")


def self_check(script, argv, run_dir):
    """Run the checks for `script` (a path) with its command-line arguments `argv`, print the table and write it to
    run_dir/self_check.md -> the exit code."""
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the first process checks, with as many processes as this launch
    if os.environ.get("WORLD_SIZE", "1") != os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")):
        print("error: --self_check runs on one node: launch it on one machine with that node's processes",
              file=sys.stderr)
        return 1
    argv = [a for i, a in enumerate(argv) if a not in (*DROPPED, *OWN_FLAGS)
            and (i == 0 or argv[i - 1] not in OWN_FLAGS)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        run = _runner(script, argv, folder)
        straight = run("straight", ["--total_steps", "2"])
        if straight["error"] and not straight["metrics"]:
            print(f"self-check: the run did not start: {straight['error']}", file=sys.stderr)
            return 1
        config = straight["config"]
        rows += _on_policy(straight)
        rows.append(_alarm(run, config))
        rows.append(_sleep(straight, config))
        run("resumed", ["--total_steps", "1", "--save_every", "1"])
        resumed = run("resumed", ["--total_steps", "2", "--resume"])
        if len(resumed["metrics"]) == 2 and len(straight["metrics"]) == 2:
            diffs = {k: abs(resumed["metrics"][1][k] - straight["metrics"][1][k]) / max(
                abs(straight["metrics"][1][k]), 1e-8) for k in COMPARED if k in straight["metrics"][1]}
            sharded = os.path.isdir(os.path.join(folder, f"resumed__{_seed(argv)}", "checkpoint",
                                                 "pytorch_model_fsdp_0"))
            rows.append(("resume", max(diffs.values()) < 1e-4, "step 2 after a resume "
                         f"(from {'FSDP2 shards' if sharded else 'one checkpoint file'}) against uninterrupted: "
                         + ", ".join(f"{k} rel. diff {v:.1g}" for k, v in diffs.items())))
        else:
            rows.append(("resume", False, "the stopped or the resumed run did not complete: "
                         + (resumed["error"] or straight["error"])))
    rows.append(_reward(config))
    lines = [f"self-check of `{os.path.basename(script)} {shlex.join(argv)}`, its runs launched as {_launch_words()}",
             "", "| check | result | numbers |", "|---|---|---|"] + [
        f"| {name} | {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    print("\n".join(lines))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "self_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    failed = [name for name, ok, _ in rows if ok is False]
    print(f"self-check: {'FAILED: ' + ', '.join(failed) if failed else 'every check passed'} "
          f"(report: {os.path.join(run_dir, 'self_check.md')})")
    return 1 if failed else 0


def _runner(script, argv, folder):
    """A function running `script` with argv and extra flags as a run of `folder`, the way this process was launched
    (as many processes) -> {"metrics": its metrics.jsonl rows, "config": its args.json, "error": the line of its
    output that says why it stopped ("" if it did not fail), "output": its stderr}."""
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def run(name, extra, environment=None):
        launch = [sys.executable] if not _launched() else [sys.executable, "-m", "torch.distributed.run",
                                                            "--nproc_per_node", str(world), "--master_port",
                                                            str(free_port())]
        flags = [*argv, "--output_dir", folder, "--exp_name", name, "--eval_every", "1", "--eval_size", str(world),
                 "--eval_samples", "1", "--prior_eval_size", str(world), "--kl_prompts", str(world),
                 "--log_completions_every", "0", *extra]  # (the smallest evaluation every process takes part in)
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and not k.startswith("TORCHELASTIC_")}
        proc = subprocess.run([*launch, script, *flags], env={**env, **(environment or {})}, capture_output=True,
                              text=True)
        path = os.path.join(folder, f"{name}__{_seed(argv)}")
        metrics = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))] if os.path.exists(
            os.path.join(path, "metrics.jsonl")) else []
        config = json.load(open(os.path.join(path, "args.json"))) if os.path.exists(
            os.path.join(path, "args.json")) else {}
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        error = "" if proc.returncode == 0 else (errors or proc.stderr.strip().splitlines() or [""])[-1]
        if proc.returncode != 0 and not environment:
            print(proc.stderr[-3000:], file=sys.stderr)
        return {"metrics": metrics, "config": config, "error": error, "output": proc.stderr}
    return run


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # a launch's own


def _launched():
    """Whether this process was started by a launcher (accelerate launch, torchrun), not a plain `python`."""
    return "LOCAL_RANK" in os.environ


def _launch_words():
    """How the check's runs are launched, for the report."""
    if not _launched():
        return "this one: `python`"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP") == "true"
    return (f"this one: torchrun, {os.environ.get('WORLD_SIZE', '1')} process(es), mixed precision "
            f"{os.environ.get('ACCELERATE_MIXED_PRECISION', 'no')}, "
            f"{'FSDP' + os.environ.get('FSDP_VERSION', '1') if fsdp else 'no FSDP'}")


def _on_policy(straight):
    """The on-policy start, and the engine/trainer agreement over the straight run's steps. A script whose loss has no
    ratio checks what it logs instead: dpo.py the first mini-batch's log-ratio to the reference at step 1, 0 (the
    policy is the reference); sft.py neither (SKIP). A run that samples nothing from the current policy (sft.py's gold
    targets, dpo.py's offline or file pairs) logs no engine/trainer gap (SKIP)."""
    if not straight["metrics"]:
        return [("on-policy start", False, "the run did not complete a step: " + straight["error"])]
    first = straight["metrics"][0]
    if "policy/first_minibatch_logratio_max" in first:  # dpo.py: pi_theta against pi_ref
        logratio = first["policy/first_minibatch_logratio_max"]
        rows = [("on-policy start", logratio < 1e-5, f"first mini-batch max |log pi_theta - log pi_ref| of a "
                 f"completion at step 1: {logratio:.2g}")]
    elif "policy/ratio_mean" in first:
        ratio = first.get("policy/first_minibatch_ratio_dev_max", abs(first["policy/ratio_mean"] - 1))
        kl = first.get("losses/kl") if first.get("policy/ratio_max") == 1.0 else None  # the policy never moved
        ok = ratio < 1e-5 and (kl is None or abs(kl) < 1e-6)
        rows = [("on-policy start", ok, f"first mini-batch |ratio - 1| {ratio:.2g}" + (
            f", KL {kl:.2g}" if kl is not None else ", KL: no term, or the policy moved within the step (mu > 1)"))]
    else:
        rows = [("on-policy start", None, "the loss has no ratio to an old or a reference policy")]
    gaps, bound = [r.get("rollout/logprob_gap_mean") for r in straight["metrics"]], _agreement_bound(straight["config"])
    if None in gaps:
        rows.append(("engine/trainer agreement", None, "the run samples nothing from the current policy: no gap"))
    else:
        rows.append(("engine/trainer agreement", max(gaps) <= bound, f"mean log-prob gap per step "
                     f"{', '.join(f'{g:.2g}' for g in gaps)} (bound {bound:g})"))
    return rows


def _uses_vllm(config):
    engine = config.get("run", {}).get("engine", "auto")
    return engine == "vllm" or (engine == "auto" and _cuda() and _vllm_installed())


def _alarm(run, config):
    if not _uses_vllm(config):
        return ("stale-weights alarm", None, "the HF decode loop samples from the trainer's own weights: no push")
    broken = run("broken_push", ["--total_steps", "1"], environment={BREAK_PUSH_VARIABLE: "1"})
    if broken["metrics"] and "rollout/logprob_gap_mean" not in broken["metrics"][0]:
        return ("stale-weights alarm", None, "the run samples nothing from the current policy: no gap to watch")
    gap = broken["metrics"][0]["rollout/logprob_gap_mean"] if broken["metrics"] else None
    warn, stop = config["run"]["logprob_gap_warn"], config["run"]["logprob_gap_stop"]
    stopped = "exceeds --logprob_gap_stop" in broken["output"]
    ok = gap is not None and gap > warn and (stopped or not stop)
    return ("stale-weights alarm", ok, f"with the pushed weights broken the mean gap is "
            f"{gap if gap is None else f'{gap:.3g}'} (warning above {warn}, stop above {stop}): the run "
            f"{'stopped' if stopped else 'did not stop'}")


def _sleep(straight, config):
    """Step 2 samples from weights that slept through step 1's evaluation."""
    if not (_cuda() and _uses_vllm(config)):
        return ("sleep", None, "no sleep mode here (vLLM's sleep needs a GPU)")
    if len(straight["metrics"]) < 2:
        return ("sleep", False, "the run did not reach step 2")
    if "rollout/logprob_gap_mean" not in straight["metrics"][1]:
        return ("sleep", None, "the run samples nothing from the current policy: no gap to check a woken engine by")
    level, gap, bound = config["run"]["vllm_sleep_level"], straight["metrics"][1]["rollout/logprob_gap_mean"], (
        _agreement_bound(config))
    return ("sleep", gap <= bound, f"step 2 sampled after a level-{level} sleep and wake through step 1's evaluation "
            f"({'weights kept, not pushed again' if level == 1 else 'weights dropped, pushed again'}): mean gap "
            f"{gap:.2g} (bound {bound:g})")


def _agreement_bound(config):
    """The gap after a push that the engine and the trainer computing alike allow: float rounding for a float32
    engine (CPU: ~1e-6 measured), --logprob_gap_warn for a bf16 one (a GPU's: 0.01-0.06 measured)."""
    return config["run"]["logprob_gap_warn"] if _cuda() else 1e-3


def _reward(config):
    """Gold answers in the asked-for form score 1; empty, doubled and hedged ones score 0 (the run's task, answer
    format and prompt, from its args.json)."""
    from plumbing.models import load_tokenizer
    from utils.rewards import score_completions
    from utils.tasks import TOY_TASKS, load_splits

    if not config:
        return ("reward", False, "the run wrote no args.json")
    task, answer_format = config["task"], config["answer_format"]
    tokenizer, _ = load_tokenizer(config["model"])
    train, _, _ = load_splits(task, tokenizer, answer_format, config["instruction"], config["max_prompt_length"], 1, 1,
                              0)
    picked = [train[i] for i in np.random.default_rng(0).choice(len(train), min(4, len(train)), replace=False)]
    tags = task in TOY_TASKS or answer_format == "answer_tags"
    box = (lambda a: f"<answer>{a}</answer>") if tags else (lambda a: f"\\boxed{{{a}}}")
    golds = [r["answer"] for r in picked]
    cases = {"gold": [f"So the answer is {box(g)}" for g in golds], "empty": [box("") for _ in golds],
             "doubled": [box(g + g) for g in golds],  # the gold written twice over: another answer
             "hedged": [f"{box(g)} or {box(g + '1')}" for g in golds]}  # two answers, one right
    scores = {name: score_completions(texts, picked, task, answer_format)[0] for name, texts in cases.items()}
    ok = all(s == 1.0 for s in scores["gold"]) and not any(any(scores[k]) for k in ("empty", "doubled", "hedged"))
    return ("reward", ok, "accuracy of " + ", ".join(f"{k} answers {np.mean(v):.2f}" for k, v in scores.items()) +
            f" ({len(golds)} training rows)")


def _seed(argv):
    return argv[argv.index("--seed") + 1] if "--seed" in argv else "1"


def _cuda():
    import torch

    return torch.cuda.is_available()


def _vllm_installed():
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
