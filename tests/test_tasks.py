"""Task loading through the hub-dataset code path, on local files of the same shape (no hub access in tests)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from utils.tasks import (TOY_MODEL_DIR, check_task, format_prompt, load_task, normalize_rows, toy_mul_problems,
                         toy_problems)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOY_MODEL_DIR)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_parquet(path, rows):
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return str(path)


GSM8K_ROWS = [{"question": f"Tom has {i} apples and buys {i + 1}. How many?", "answer": f"{i} + {i + 1} = "
               f"{2 * i + 1}\n#### {2 * i + 1:,}"} for i in range(995, 1015)]
MATH_ROWS = [{"problem": f"Compute $\\frac{{{i}}}{{{i + 1}}} + 0$.",
              "solution": f"It is $\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}$.", "level": "Level 1", "type": "Algebra"}
             for i in range(1, 21)]


def test_toy_split_is_disjoint_and_complete():
    train, test = toy_problems("train"), toy_problems("test")
    assert len(train) == 9500 and len(test) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {"prompt": "07+45=", "question": "07+45=", "answer": "052"} in train + test
    train, test = toy_mul_problems("train"), toy_mul_problems("test")
    assert len(train) == 80_500 and len(test) == 500 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {"prompt": "347*86=", "question": "347*86=", "answer": "29842"} in train + test


def test_tokenizer_round_trips(tokenizer):
    """AutoTokenizer may load the folder as Qwen2Tokenizer: it must still be one token per character, lossless."""
    text = "07+45= 7+5=12\n<answer>052</answer> \\boxed{\\frac{1}{3}} é"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer("07+45=", add_special_tokens=False)["input_ids"]) == 6
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0


@pytest.mark.parametrize("writer, ext", [(write_parquet, "parquet"), (write_jsonl, "jsonl")])
def test_gsm8k_shaped_folder(tmp_path, tokenizer, writer, ext):
    writer(tmp_path / f"train.{ext}", GSM8K_ROWS[:15])
    writer(tmp_path / f"test.{ext}", GSM8K_ROWS[15:])
    rows, counts = load_task(str(tmp_path), "train", tokenizer)
    assert len(rows) == 15 and counts == {"dropped_gold": 0, "dropped_long": 0}
    q = GSM8K_ROWS[0]["question"]
    assert rows[0] == {"prompt": q, "question": q, "answer": "1991"}  # after '####', commas removed
    assert len(load_task(str(tmp_path), "test", tokenizer)[0]) == 5


def test_math_shaped_file_holds_out_its_tail(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    train, _ = load_task(path, "train", tokenizer, eval_size=500)
    test, _ = load_task(path, "test", tokenizer, eval_size=500)
    assert len(train) == 18 and len(test) == 2  # 10% held out
    assert train[0]["answer"] == "\\frac{1}{2}"  # the last boxed{} of the solution
    assert test[-1]["answer"] == "\\frac{20}{21}"


def test_unparseable_gold_and_long_prompts_are_dropped_with_counts(tmp_path, tokenizer):
    rows = [{"prompt": "short", "answer": "3"}, {"prompt": "long " * 200, "answer": "4"},
            {"prompt": "bad gold", "answer": ""}, {"problem": None, "solution": "no box here"}][:3]
    rows += [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kept, counts = load_task(path, "train", tokenizer, max_prompt_length=64)
    assert counts == {"dropped_gold": 1, "dropped_long": 1}
    assert all(len(r["prompt"]) <= 64 for r in kept)


def test_missing_fields_error_says_what_is_needed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hi", "label": 1}] * 12)
    with pytest.raises(ValueError, match=r"needs one of \('prompt', 'question', 'problem'\)"):
        load_task(path, "train", tokenizer)


def test_unknown_task_and_bad_extension():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        check_task("gsm9k")
    with pytest.raises(ValueError, match="expected one of"):
        check_task(__file__)
    check_task("gsm8k")
    check_task("toy")


def test_normalize_rows_on_plain_lists():
    rows, dropped = normalize_rows([{"problem": "p", "answer": "\\frac{1}{2}"}], "rows")
    assert rows == [{"prompt": "p", "answer": "\\frac{1}{2}"}] and dropped == 0


def test_chat_template_and_system_prompt():
    class ChatTokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return " | ".join(f"{m['role']}: {m['content']}" for m in messages)

    assert "\\boxed{}" in format_prompt(ChatTokenizer(), "What is 2+2?", "boxed")
    assert "<answer>" in format_prompt(ChatTokenizer(), "What is 2+2?", "answer_tags")
    assert format_prompt(type("NoChat", (), {"chat_template": None})(), "q", "boxed") == "q"


@pytest.mark.parametrize("offline_env", [
    {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},  # declared offline
    {"HF_ENDPOINT": "http://127.0.0.1:9"},  # a hub that cannot be reached (nothing listens on port 9)
])
def test_hub_task_offline_fails_fast_with_a_clear_message(tmp_path, offline_env):
    env = dict(os.environ, HF_HOME=str(tmp_path), **offline_env)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(key, "0")
    out = subprocess.run([sys.executable, "grpo.py", "--task", "gsm8k", "--output_dir", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # (retries would take minutes)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "could not load task 'gsm8k'" in last and "--task path/to/file.jsonl" in last, last


@pytest.mark.slow
def test_toy_model_script_is_deterministic_and_matches_the_shipped_tokenizer(tmp_path):
    """toy_model/make_toy_model.py rebuilds the shipped folder (full rebuild: bit-identical on this machine, 20 s)."""
    from safetensors.torch import load_file

    from toy_model import make_toy_model

    for name in ("a", "b"):
        make_toy_model.main(str(tmp_path / name), steps=10)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert open(tmp_path / "a" / "tokenizer.json").read() == open(os.path.join(TOY_MODEL_DIR, "tokenizer.json")).read()
    shipped = load_file(os.path.join(TOY_MODEL_DIR, "model.safetensors"))
    assert {k: v.shape for k, v in shipped.items()} == {k: v.shape for k, v in a.items()}
    for name in ("tools_a", "tools_b"):  # the tool warm-up (grpo_tools.py's model), from the shipped model
        make_toy_model.main_tools(str(tmp_path / name), steps=8)
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("tools_a", "tools_b"))
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["model.norm.weight"],
                                                                       shipped["model.norm.weight"])


def test_empty_malformed_and_tiny_files_say_what_is_wrong(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_task(str(empty), "train", tokenizer)
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(20)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows[:6] + ['{"prompt": "q6", "answer": '] + rows[7:]) + "\n")
    with pytest.raises(ValueError, match=r"line 7: not valid JSON"):
        load_task(str(bad), "train", tokenizer)
    tiny = write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    train, test = (load_task(tiny, split, tokenizer)[0] for split in ("train", "test"))
    assert len(train) == 4 and len(test) == 1  # under 10 rows: one row held out (it was none, then an IndexError)
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ValueError, match="needs at least 2"):
        load_task(one, "train", tokenizer)


RG_TASK = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=2"


def test_reasoning_gym_task_is_seeded_and_its_splits_are_disjoint(tokenizer):
    train, counts = load_task(RG_TASK, "train", tokenizer)
    test, _ = load_task(RG_TASK, "test", tokenizer)
    assert len(test) == 500 and len(train) + counts["dropped_in_test"] == 10_000
    assert counts["dropped_in_test"] > 0  # a small option range repeats questions: those are removed from train
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    again, _ = load_task(RG_TASK, "train", tokenizer)
    assert [r["question"] for r in again] == [r["question"] for r in train]  # generated from fixed seeds
    row = test[0]
    assert row["entry"]["question"] == row["question"] and row["answer"] == str(row["entry"]["answer"])
    assert row["entry"]["metadata"]["source_dataset"] == "chain_sum"


def test_reasoning_gym_task_options_and_errors():
    from utils.tasks import parse_rg_task

    assert parse_rg_task("rg:chain_sum") == ("chain_sum", {})
    assert parse_rg_task("rg:x:a=2,b=0.5,c=true,d=hi") == ("x", {"a": 2, "b": 0.5, "c": True, "d": "hi"})
    check_task(RG_TASK)
    for task, message in [("rg:no_such_task", "not registered"), ("rg:chain_sum:foo=1", "unexpected keyword"),
                          ("rg:chain_sum:min_terms=3,max_terms=2", "reasoning-gym refused it"),
                          ("rg:chain_sum:min_terms", "key=value pairs")]:
        with pytest.raises(ValueError, match=message) as error:
            check_task(task)
        assert "\n" not in str(error.value)


def test_instruction_placement():
    class ChatTokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return " | ".join(f"{m['role']}: {m['content']}" for m in messages)

    assert format_prompt(ChatTokenizer(), "What is 2+2?", "boxed", "user") == (
        "user: What is 2+2?\nGive the final answer as \\boxed{ANSWER}.")
    assert format_prompt(ChatTokenizer(), "What is 2+2?", "boxed").startswith("system: Please reason")
    tool = "Use the tool."  # grpo_tools.py's instruction goes before the answer format's, in the same place
    assert format_prompt(ChatTokenizer(), "What is 2+2?", "boxed", "user", tool) == (
        "user: What is 2+2?\nUse the tool. Give the final answer as \\boxed{ANSWER}.")
    assert format_prompt(ChatTokenizer(), "What is 2+2?", "boxed", "system", tool).startswith(
        "system: Use the tool. Please reason")
