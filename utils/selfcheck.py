"""--self_check: run this configuration for a few steps, on this machine, and check what must hold wherever it runs.

The checks (each PASS, FAIL or SKIP with its numbers; the exit code is 1 when one fails):
- on-policy start: at step 1 the first mini-batch's ratio pi_theta / pi_old is 1, and with mu = 1 and a KL term the
  KL to the reference is 0 (the reference is the policy);
- engine/trainer agreement: every step's mean log-prob gap after the weight push is under a bound: 1e-3 for a float32
  engine (a CPU), --logprob_gap_warn for a bf16 one (a GPU);
- stale-weights alarm: a run whose weight push is broken on purpose (the engine gets other weights) is stopped by the
  same measure, above --logprob_gap_stop (vLLM engines: the HF decode loop samples from the trainer's own weights);
- sleep: the engine's log-probs of its own completions after a sleep and wake equal those it sampled them with (GPU
  sleep mode; skipped elsewhere);
- resume: a run stopped after step 1 and resumed gives step 2's metrics as an uninterrupted run;
- staleness 0 (grpo_async.py): --max_staleness 0 --tis_cap 0 gives grpo.py's steps;
- reward: the gold answers of a few training rows, written in the asked-for form, score full accuracy; empty answers,
  the gold written twice over (another answer) and hedged ones (the gold and another answer) score none.
The runs go to a temporary folder; the run's own folder gets only the report, self_check.md. Under `accelerate launch`
the first process runs the check with the same number of processes and the others end at once.
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

WRAPPER = """import importlib.util, sys, tyro


def run():
    spec = importlib.util.spec_from_file_location("script", {script!r})
    script = importlib.util.module_from_spec(spec)
    sys.modules["script"] = script
    spec.loader.exec_module(script)
{patch}
    script.main(tyro.cli(script.Args, args=sys.argv[1:]))


if __name__ == "__main__":  # the reward workers (forkserver) import this file again: they must not start a run
    run()
"""
BREAK_PUSH = """import torch
from utils.parallel import policy_weights
def broken_push(engine, model, accelerator):  # the engine gets other weights (noise as large as them): weights lost
    noisy = ((n, t + t.float().std() * torch.randn_like(t)) for n, t in policy_weights(model, accelerator))
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": noisy})
    engine.llm.reset_prefix_cache()
script.push_weights = broken_push"""
COMPARED = ("charts/reward", "charts/completion_length", "losses/policy", "policy/grad_norm")


def self_check(script, args, argv, resolve_args):
    """Run the checks for `script` (a path) with its command-line arguments `argv` (parsed: `args`; --self_check,
    --resume, --output_dir and --exp_name are the check's own), print the table and write it to the run's folder
    -> the exit code. resolve_args: the script's."""
    from utils.runs import run_name

    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the first process checks, with as many processes as this launch
    run_dir = os.path.join(args.run.output_dir, run_name(os.path.splitext(os.path.basename(script))[0], args,
                                                         args.exp_name, args.model, args.task, args.seed))
    try:
        args = resolve_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    own = {"--output_dir", "--output-dir", "--exp_name", "--exp-name"}
    argv = [a for i, a in enumerate(argv) if a not in ("--self_check", "--self-check", "--resume", *own)
            and (i == 0 or argv[i - 1] not in own)]
    mu, beta = args.num_epochs * args.num_minibatches, getattr(args, "beta", 0.0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        run = _runner(script, argv, folder)
        straight, _ = run("straight", ["--total_steps", "2"])
        first = straight[0] if straight else {}
        if not straight:
            rows.append(("on-policy start", False, "the run did not complete a step (see its output above)"))
        else:
            ratio = first.get("policy/first_minibatch_ratio_dev_max", abs(first["policy/ratio_mean"] - 1) if mu == 1
                              else None)
            kl = first.get("losses/kl") if mu == 1 and beta > 0 else None
            ok = ratio is not None and ratio < 1e-5 and (kl is None or abs(kl) < 1e-6)
            rows.append(("on-policy start", ok, f"first mini-batch |ratio - 1| {ratio:.2g}" +
                         (f", KL {kl:.2g}" if kl is not None else ", KL: no term or not logged apart (mu > 1)")))
            gaps, bound = [r["rollout/logprob_gap_mean"] for r in straight], _agreement_bound(args)
            rows.append(("engine/trainer agreement", max(gaps) <= bound, f"mean log-prob gap per step "
                         f"{', '.join(f'{g:.2g}' for g in gaps)} (bound {bound:g})"))
        rows.append(_alarm(run, args))
        rows.append(_sleep(script, args, argv, folder))
        run("resumed", ["--total_steps", "1", "--save_every", "1"])
        resumed, _ = run("resumed", ["--total_steps", "2", "--resume"])
        if len(resumed) == 2 and len(straight) == 2:
            diffs = {k: abs(resumed[1][k] - straight[1][k]) / max(abs(straight[1][k]), 1e-8) for k in COMPARED}
            rows.append(("resume", max(diffs.values()) < 1e-4, "step 2 after a resume against uninterrupted: "
                         + ", ".join(f"{k} rel. diff {v:.1g}" for k, v in diffs.items())))
        else:
            rows.append(("resume", False, "the stopped or the resumed run did not complete (see its output above)"))
        rows.append(_staleness(script, run, argv, folder))
    rows.append(_reward(args))
    lines = [f"self-check of `{os.path.basename(script)} {shlex.join(argv)}`", "", "| check | result | numbers |",
             "|---|---|---|"] + [f"| {name} | {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |"
                                 for name, ok, detail in rows]
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
    (as many processes) -> (its metrics rows, its stderr's last line)."""
    def run(name, extra, patch="", other_script=None):
        wrapper = os.path.join(folder, f"{name}_launch.py")
        with open(wrapper, "w") as f:
            f.write(WRAPPER.format(script=other_script or script, patch=textwrap.indent(patch, "    ")))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launch = [sys.executable] if world == 1 else [sys.executable, "-m", "accelerate.commands.launch",
                                                      "--multi_gpu", "--num_processes", str(world),
                                                      "--main_process_port", str(_free_port())]
        flags = [*argv, "--output_dir", folder, "--exp_name", name, "--eval_every", "0", "--log_completions_every",
                 "0", *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                                  "MASTER_ADDR", "LOCAL_WORLD_SIZE")}
        proc = subprocess.run([*launch, wrapper, *flags], env=dict(env, PYTHONPATH=_path(script)), capture_output=True,
                              text=True)
        if proc.returncode != 0 and not patch:
            print(proc.stderr[-3000:], file=sys.stderr)
        path = os.path.join(folder, f"{name}__{_seed(argv)}", "metrics.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        return rows, (proc.stderr.strip().splitlines() or [""])[-1]
    return run


def _alarm(run, args):
    if args.run.engine == "hf" or (args.run.engine == "auto" and not _cuda()):
        return ("stale-weights alarm", None, "the HF decode loop samples from the trainer's own weights: no push")
    rows, last = run("broken_push", ["--total_steps", "1"], patch=BREAK_PUSH)
    gap = rows[0]["rollout/logprob_gap_mean"] if rows else None
    stopped = "--logprob_gap_stop" in last
    ok = gap is not None and gap > args.run.logprob_gap_warn and (stopped or not args.run.logprob_gap_stop)
    return ("stale-weights alarm", ok, f"with the engine on other weights the mean gap is "
            f"{gap if gap is None else f'{gap:.3g}'} (warning above {args.run.logprob_gap_warn}, stop above "
            f"{args.run.logprob_gap_stop}): the run {'stopped' if stopped else 'did not stop'}")


def _agreement_bound(args):
    """The gap after a push that the engine and the trainer computing alike allow: float rounding for a float32
    engine (CPU: ~1e-6 measured), --logprob_gap_warn for a bf16 one (a GPU's: 0.01-0.06 measured)."""
    return args.run.logprob_gap_warn if _cuda() else 1e-3


SLEEP_CHECK = """import importlib.util, json, sys, torch, tyro
from vllm import SamplingParams
from utils.engine import create_engine
spec = importlib.util.spec_from_file_location("script", {script!r})
script = sys.modules["script"] = importlib.util.module_from_spec(spec)  # tyro reads Args' source through it
spec.loader.exec_module(script)
args = tyro.cli(script.Args, args=sys.argv[1:])
accelerator, args, _, _, tokenizer, stop_ids, rows, _ = script.start_run(args)
model, _, _ = script.load_models(args, tokenizer, accelerator, with_reference=False)
engine = create_engine(args.run, args.model, args.seed, args.max_prompt_length + 17, stop_ids)
prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:4]]

def sample(prompts, params):  # the script's sequence: wake (a level-2 sleep dropped the weights: pushed), sample, sleep
    script.wake_engine(engine, model, accelerator, 0)
    outs = engine.llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
    script.sleep_engine(engine)
    return outs

before = [out.outputs[0] for out in sample(prompts, SamplingParams(max_tokens=16, logprobs=0))]
after = sample([p + list(s.token_ids) for p, s in zip(prompts, before)], SamplingParams(max_tokens=1, prompt_logprobs=0))
gaps = [abs(a[t].logprob - b[t].logprob) for p, s, out in zip(prompts, before, after)
        for t, a, b in zip(s.token_ids, s.logprobs, out.prompt_logprobs[len(p):])]
print(json.dumps({{"mean_gap": sum(gaps) / len(gaps), "max_gap": max(gaps)}}))
"""


def _sleep(script, args, argv, folder):
    """The engine's log-probs of its own sampled completions, before sleeping and after waking (GPU sleep mode)."""
    if not _cuda() or args.run.engine == "hf":
        return ("sleep", None, "no sleep mode here (vLLM's sleep needs a GPU)")
    path = os.path.join(folder, "sleep_check.py")
    with open(path, "w") as f:
        f.write(SLEEP_CHECK.format(script=script))
    flags = [*argv, "--output_dir", folder, "--exp_name", "sleep"]
    proc = subprocess.run([sys.executable, path, *flags], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=_path(script)))
    if proc.returncode != 0:
        return ("sleep", False, "the check failed: " + (proc.stderr.strip().splitlines() or [""])[-1])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return ("sleep", result["mean_gap"] <= args.run.logprob_gap_warn, f"log-probs after sleep level "
            f"{args.run.vllm_sleep_level} and wake against before: mean gap {result['mean_gap']:.2g}, max "
            f"{result['max_gap']:.2g} (bound {args.run.logprob_gap_warn})")


def _staleness(script, run, argv, folder):
    """grpo_async.py with --max_staleness 0 --tis_cap 0 against grpo.py with the same flags: the same steps."""
    if "--max_staleness" not in open(script).read():
        return ("staleness 0", None, "grpo_async.py only")
    async_flags = {"--overprovision", "--max_staleness", "--tis_cap", "--tis_mode"}
    sync_argv = [a for i, a in enumerate(argv) if a not in async_flags and (i == 0 or argv[i - 1] not in async_flags)]
    limit, _ = run("staleness_0", ["--total_steps", "2", "--max_staleness", "0", "--tis_cap", "0"])
    sync, _ = _runner(os.path.join(os.path.dirname(os.path.abspath(script)), "grpo.py"), sync_argv, folder)(
        "grpo", ["--total_steps", "2"])
    ok = len(limit) == len(sync) == 2 and all(a[k] == b[k] for a, b in zip(limit, sync) for k in COMPARED)
    return ("staleness 0", ok, "--max_staleness 0 --tis_cap 0 against grpo.py, 2 steps: " +
            ("equal" if ok else "different: " + ", ".join(f"{k} {[r.get(k) for r in limit]} vs "
                                                         f"{[r.get(k) for r in sync]}" for k in COMPARED)))


def _reward(args):
    """Gold answers in the asked-for form score 1; empty, doubled and hedged ones score 0."""
    from utils.models import load_tokenizer
    from utils.rewards import score_completions
    from utils.tasks import TOY_TASKS, load_splits

    tokenizer, _ = load_tokenizer(args.model)
    train, _, _ = load_splits(args.task, tokenizer, args.answer_format, args.instruction, args.max_prompt_length, 1,
                              1, 0)
    picked = [train[i] for i in np.random.default_rng(0).choice(len(train), min(4, len(train)), replace=False)]
    tags = args.task in TOY_TASKS or args.answer_format == "answer_tags"
    box = (lambda a: f"<answer>{a}</answer>") if tags else (lambda a: f"\\boxed{{{a}}}")
    golds = [r["answer"] for r in picked]
    cases = {"gold": [f"So the answer is {box(g)}" for g in golds], "empty": [box("") for _ in golds],
             "doubled": [box(g + g) for g in golds],  # the gold written twice over: another answer
             "hedged": [f"{box(g)} or {box(g + '1')}" for g in golds]}  # two answers, one right
    scores = {name: score_completions(texts, picked, args.task, args.answer_format)[0] for name, texts in
              cases.items()}
    ok = all(s == 1.0 for s in scores["gold"]) and not any(any(scores[k]) for k in ("empty", "doubled", "hedged"))
    return ("reward", ok, "accuracy of " + ", ".join(f"{k} answers {np.mean(v):.2f}" for k, v in scores.items()) +
            f" ({len(golds)} training rows)")


def _path(script):
    """PYTHONPATH for a run of `script`: its folder, then what this process had."""
    return os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(script)), os.environ.get("PYTHONPATH")) if p)


def _seed(argv):
    return argv[argv.index("--seed") + 1] if "--seed" in argv else "1"


def _cuda():
    import torch

    return torch.cuda.is_available()


def _free_port():
    from utils.parallel import free_port

    return free_port()
