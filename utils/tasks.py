"""Tasks: lists of {"prompt", "answer"} rows for training and evaluation.

- "toy": zero-padded two-digit addition, the embedded default ("07+45=" -> "<answer>052</answer>").
- "toy_mul": three-digit times two-digit multiplication ("347*86=" -> "<answer>29842</answer>"), grpo_tools.py's
  default: the embedded model cannot multiply in its head, but can with one call of the Python tool.
- "gsm8k" (openai/gsm8k, config main), "math" (train DigitalLearningGmbH/MATH-lighteval, test HuggingFaceH4/MATH-500),
  loaded with `datasets`.
- a local .jsonl/.json/.parquet file, or a folder holding train.* and test.* files. Rows are read through the same
  code path as the hub datasets, so GSM8K-shaped (question, answer "... #### 72") and MATH-shaped (problem, solution
  with a boxed answer, or problem, answer) files work as well as plain {prompt, answer} rows.
- "rg:NAME" or "rg:NAME:key=value,key=value": a procedural task of reasoning-gym (e.g. rg:chain_sum:min_terms=2,
  max_terms=3), generated at load time from fixed seeds, train and test disjoint; each row keeps its reasoning-gym
  entry, whose dataset's own score_answer is the verifier (run in the reward workers).
"""

import contextlib
import glob
import json
import os
import socket

import numpy as np

from utils.rewards import ANSWER_PLACEHOLDER, extract_boxed, gold_parses

TOY_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy_model")
HUB_TASKS = {  # name: (train (path, config, split), test (path, config, split))
    "gsm8k": (("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")),
    "math": (("DigitalLearningGmbH/MATH-lighteval", "default", "train"), ("HuggingFaceH4/MATH-500", None, "test")),
}
SYSTEM_PROMPTS = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "answer_tags": "Think step by step, then give only the final answer inside <answer> </answer> tags.",
}
RG_TRAIN_SIZE, RG_TEST_SIZE = 10_000, 500  # rows generated per split of a reasoning-gym task
RG_TRAIN_SEED, RG_TEST_SEED = 0, 10**9  # entry i uses seed + i: these never meet
USER_INSTRUCTIONS = {  # a copy of the placeholder is never a readable answer (utils/rewards.py)
    "boxed": f"Give the final answer as \\boxed{{{ANSWER_PLACEHOLDER}}}.",
    "answer_tags": f"Give the final answer as <answer>{ANSWER_PLACEHOLDER}</answer>.",
}
# calibrated.py's request for a stated probability (arXiv 2512.19920), before the answer format's; a copied
# <confidence>P</confidence> holds no number, and scores as a malformed probability
CONFIDENCE_INSTRUCTION = ("End with the probability, from 0 to 1, that your final answer is correct, as "
                          "<confidence>P</confidence> after it; if you do not know, give IDK as the final answer.")
ANSWER_DELIMITERS = {"boxed": ("\\boxed{", "}"), "answer_tags": ("<answer>", "</answer>")}  # around the answer
PROMPT_FIELDS, ANSWER_FIELDS = ("prompt", "question", "problem"), ("answer", "solution")
DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def toy_problems(split):
    """All 10,000 zero-padded a+b problems, 500 held out for evaluation by a fixed permutation."""
    order = np.random.default_rng(1234).permutation(10_000)
    chosen = order[:500] if split == "test" else order[500:]
    prompts = [(f"{i // 100:02d}+{i % 100:02d}=", f"{i // 100 + i % 100:03d}") for i in sorted(chosen)]
    return [{"prompt": prompt, "question": prompt, "answer": answer} for prompt, answer in prompts]


def toy_mul_problems(split):
    """All 81,000 a*b problems (a three digits, b two), 500 held out for evaluation by a fixed permutation."""
    order = np.random.default_rng(1234).permutation(81_000)
    chosen = order[:500] if split == "test" else order[500:]
    pairs = [(100 + i // 90, 10 + i % 90) for i in sorted(chosen)]
    return [{"prompt": f"{a}*{b}=", "question": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs]


TOY_TASKS = {"toy": toy_problems, "toy_mul": toy_mul_problems}  # raw prompts, answers in tags, exact match


def is_toy_shaped(model):
    """The embedded model, or a model trained from it (same architecture and vocabulary): it gets the toy's defaults."""
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f, open(os.path.join(TOY_MODEL_DIR, "config.json")) as g:
        mine, toy = json.load(f), json.load(g)
    return all(mine.get(k) == toy[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"))


def check_model(model):
    """Fail fast on a model that is neither a local folder nor a hub id that can be loaded now. Offline, a hub id must
    be in the local cache (then the hub is not asked at all: its retries take ~55 s before failing)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if os.path.isdir(model):
        return
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"--model {model!r} is neither a local folder nor a hub id like Qwen/Qwen2.5-0.5B-Instruct")
    if not constants.HF_HUB_OFFLINE and _hub_reachable():
        return
    if not isinstance(try_to_load_from_cache(model, "config.json"), str):
        raise ValueError(f"--model {model!r}: the hub is unreachable and the model is not in the local cache; pass a "
                         "local model folder")
    constants.HF_HUB_OFFLINE = True  # load from the cache without asking the hub


def parse_rg_task(task):
    """"rg:chain_sum:min_terms=2,max_terms=3" -> ("chain_sum", {"min_terms": 2, "max_terms": 3}); values are read as
    int, float, true/false, or else kept as strings."""
    _, _, rest = task.partition(":")
    name, _, options = rest.partition(":")
    parsed = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--task {task!r}: options are key=value pairs separated by commas, got {item!r}")
        for convert in (int, float, {"true": True, "false": False}.__getitem__, str):
            with contextlib.suppress(ValueError, KeyError):
                parsed[key.strip()] = convert(value.strip().lower() if convert is not str else value.strip())
                break
    return name, parsed


def rg_dataset(task, seed, size):
    """The reasoning-gym dataset of an rg: task; a bad name or option is a one-line error."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"--task {task}: the package reasoning-gym is not installed (pip install reasoning-gym)") \
            from None
    name, options = parse_rg_task(task)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
    except Exception as e:  # unknown name (ValueError), unknown option (TypeError), bad value (AssertionError)
        raise ValueError(f"--task {task}: reasoning-gym refused it ({type(e).__name__}: {e})") from None


def rg_rows(task, split):
    """A reasoning-gym task's split: the test set from its own seed, the train set with every question that is also
    in the test set removed (small option ranges repeat questions); returns (rows, count removed)."""
    test = list(rg_dataset(task, RG_TEST_SEED, RG_TEST_SIZE))
    if split == "test":
        return test, 0
    held_out = {entry["question"] for entry in test}
    train = list(rg_dataset(task, RG_TRAIN_SEED, RG_TRAIN_SIZE))
    kept = [entry for entry in train if entry["question"] not in held_out]
    return kept, len(train) - len(kept)


def check_task(task):
    """Fail fast on a task that is neither a known name nor an existing local file/folder."""
    if task in TOY_TASKS or task in HUB_TASKS:
        return
    if task.startswith("rg:"):
        rg_dataset(task, seed=0, size=1)
        return
    if not os.path.exists(task):
        raise ValueError(f"unknown task {task!r}: use toy, toy_mul, gsm8k, math, rg:NAME (reasoning-gym), or a path to "
                         "a .jsonl/.parquet file or folder")
    if os.path.isfile(task) and os.path.splitext(task)[1] not in DATA_EXTENSIONS:
        raise ValueError(f"task file {task!r}: expected one of {sorted(DATA_EXTENSIONS)}")


def _local_files(task, split):
    if os.path.isfile(task):
        return [task]
    files = [f for f in sorted(glob.glob(os.path.join(task, f"{split}*"))) if os.path.splitext(f)[1] in DATA_EXTENSIONS]
    if not files:
        raise ValueError(f"task folder {task!r} has no {split}.jsonl/{split}.parquet file")
    return files


def _hub_reachable(timeout=3.0):
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _load_split(task, split):
    import datasets
    from huggingface_hub import constants

    files = [] if task in HUB_TASKS else _local_files(task, split)
    for path in files:
        if os.path.getsize(path) == 0:
            raise ValueError(f"task file {path!r} is empty")  # datasets would say StopIteration
    try:
        if task in HUB_TASKS:
            if not _hub_reachable():  # use the local cache only: otherwise retries take ~25 s before failing
                constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
            path, config, hub_split = HUB_TASKS[task][split == "test"]
            return datasets.load_dataset(path, config, split=hub_split)
        return datasets.load_dataset(DATA_EXTENSIONS[os.path.splitext(files[0])[1]], data_files=files, split="train")
    except Exception as e:  # no network, no cache, bad file: one line that says what to do
        for path in files:
            _find_bad_jsonl_line(path)
        where = "a local copy: --task path/to/file.jsonl (fields prompt, answer)" if task in HUB_TASKS else "the file"
        raise ValueError(f"could not load task {task!r} ({type(e).__name__}: {str(e)[:200]}); check {where}") from e


def _find_bad_jsonl_line(path):
    """After a failed load: name the first line of a JSONL file that is not a JSON object (datasets does not)."""
    if os.path.splitext(path)[1] != ".jsonl":
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"task file {path!r}, line {number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"task file {path!r}, line {number}: expected a JSON object, got {type(row).__name__}")


def _gold(answer_text, field):
    """The gold answer: after '####' for GSM8K-style answers, the last boxed{} of a MATH solution, else as is."""
    text = str(answer_text)
    if field == "solution":
        return extract_boxed(text)
    return text.split("####")[-1].strip().replace(",", "") if "####" in text else text.strip()


def normalize_rows(rows, source):
    """Map dataset rows with any of the known field names to {"prompt", "answer"}; returns (rows, dropped count)."""
    columns = list(rows.column_names) if hasattr(rows, "column_names") else list(rows[0].keys()) if rows else []
    prompt_field = next((f for f in PROMPT_FIELDS if f in columns), None)
    answer_field = next((f for f in ANSWER_FIELDS if f in columns), None)
    if prompt_field is None or answer_field is None:
        raise ValueError(f"{source} has columns {columns}; it needs one of {PROMPT_FIELDS} and one of {ANSWER_FIELDS}")
    out, dropped = [], 0
    for row in rows:
        gold = _gold(row[answer_field], answer_field)
        if gold is None or not gold_parses(gold):
            dropped += 1  # scored as 0 forever otherwise: drop it now, and count it
            continue
        out.append({"prompt": str(row[prompt_field]), "answer": gold})
    return out, dropped


def format_prompt(tokenizer, question, answer_format, instruction="system", tool_instruction=""):
    """The chat template with an instruction asking for a checkable answer: as a system turn ("system", the Qwen2.5-Math
    and DeepSeek convention), or after the question in the user turn, naming where the answer goes ("user": the
    model's own default system prompt, if its template has one, is kept); tool_instruction (grpo_tools.py: how to
    call the tool) goes before it. Raw text for template-less models."""
    if getattr(tokenizer, "chat_template", None) is None:
        return question
    tool = f"{tool_instruction} " if tool_instruction else ""
    if instruction == "user":
        messages = [{"role": "user", "content": f"{question.rstrip()}\n{tool}{USER_INSTRUCTIONS[answer_format]}"}]
    else:
        messages = [{"role": "system", "content": tool + SYSTEM_PROMPTS[answer_format]},
                    {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def gold_completion(answer, answer_format):
    """The gold answer alone, written as the reward reads it: "\\boxed{72}", "<answer>052</answer>" (sft.py's targets;
    the prior-task evaluation's forced opening is its first delimiter)."""
    opening, closing = ANSWER_DELIMITERS[answer_format]
    return f"{opening}{answer}{closing}"


def load_task(task, split, tokenizer, answer_format="boxed", max_prompt_length=512, eval_size=500,
              instruction="system", tool_instruction=""):
    """Rows {"prompt" (formatted text), "question" (as in the data), "answer"} and counts of the rows dropped.

    A single local file has no test split: its last 10 % of rows (at least one, at most `eval_size`) are held out.
    """
    if task in TOY_TASKS:
        return TOY_TASKS[task](split), {"dropped_gold": 0, "dropped_long": 0}
    if task.startswith("rg:"):
        entries, overlap = rg_rows(task, split)
        rows = [{"prompt": entry["question"], "answer": str(entry["answer"]), "entry": entry} for entry in entries]
        kept = _fit_prompts(rows, tokenizer, answer_format, max_prompt_length, instruction, tool_instruction)
        return kept, {"dropped_in_test": overlap, "dropped_long": len(rows) - len(kept)}
    data = _load_split(task, split)
    if len(data) == 0:
        raise ValueError(f"task {task!r} has no {split} rows")
    if os.path.isfile(task):
        if len(data) < 2:
            raise ValueError(f"task file {task!r} has {len(data)} row(s): it needs at least 2 (train and test)")
        n_test = min(max(eval_size, 1), max(len(data) // 10, 1))
        cut = len(data) - n_test
        data = data.select(range(cut, len(data)) if split == "test" else range(cut))
    rows, dropped_gold = normalize_rows(data, task)
    kept = _fit_prompts(rows, tokenizer, answer_format, max_prompt_length, instruction, tool_instruction)
    return kept, {"dropped_gold": dropped_gold, "dropped_long": len(rows) - len(kept)}


def _fit_prompts(rows, tokenizer, answer_format, max_prompt_length, instruction, tool_instruction=""):
    """Rows {"prompt" (formatted text), "question" (as in the data), "answer", ...} whose prompt fits."""
    prompts = [format_prompt(tokenizer, row["prompt"], answer_format, instruction, tool_instruction) for row in rows]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]] if prompts else []
    return [{**row, "prompt": prompt, "question": row["prompt"]}
            for row, prompt, length in zip(rows, prompts, lengths) if length <= max_prompt_length]


def load_splits(task, tokenizer, answer_format, instruction, max_prompt_length, eval_size, min_train, min_test,
                tool_instruction=""):
    """The run's train rows (none when min_train is 0: --eval_only) and test rows, at least min_train and min_test of
    them or a one-line error, and a one-line summary of what was dropped at load time. tool_instruction: see
    format_prompt."""
    test, test_counts = load_task(task, "test", tokenizer, answer_format, max_prompt_length, eval_size, instruction,
                                  tool_instruction)
    train, train_counts = load_task(task, "train", tokenizer, answer_format, max_prompt_length, eval_size, instruction,
                                    tool_instruction) if min_train else ([], {})
    if len(train) < min_train:
        raise ValueError(f"only {len(train)} train prompts: lower --prompts_per_step below that")
    if len(test) < min_test:
        raise ValueError(f"{len(test)} test prompts for {min_test} processes: pass --eval_every 0, or a task with "
                         "more test rows")
    return train, test, (f"task {task}: {len(train)} train / {len(test)} test prompts; dropped at load: train "
                         f"{train_counts}, test {test_counts}")


PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def load_preferences(source, tokenizer, answer_format, instruction, max_prompt_length, max_completion_length):
    """Preference pairs in TRL's format (dpo.py --data file) -> (rows, a one-line summary). source: a local
    .jsonl/.json/.parquet file or a hub dataset name (its train split) with columns prompt, chosen, rejected, each plain
    text, or conversational: prompt a list of {role, content} messages, chosen and rejected one assistant message each
    (a one-message list). A plain prompt gets the chat template with the answer-format instruction, as every task's
    question does (format_prompt); a conversational one gets the template as it is. Rows: {"prompt": the formatted
    text, "question": the prompt as given, "chosen", "rejected": token ids, the end-of-text token appended}.
    Completions longer than max_completion_length tokens are cut to it (counted in the summary); a missing column, an
    empty completion or a prompt longer than max_prompt_length is a ValueError naming the row."""
    import datasets

    extension = os.path.splitext(source)[1]
    try:
        if os.path.exists(source):
            if extension not in DATA_EXTENSIONS:
                raise ValueError(f"expected one of {sorted(DATA_EXTENSIONS)}")
            data = datasets.load_dataset(DATA_EXTENSIONS[extension], data_files=[source], split="train")
        else:
            data = datasets.load_dataset(source, split="train")
    except Exception as e:  # a bad file, no network and no cache: one line
        raise ValueError(f"--pairs {source}: could not load it ({type(e).__name__}: {str(e)[:200]})") from None
    missing = [c for c in PREFERENCE_COLUMNS if c not in data.column_names]
    if missing:
        raise ValueError(f"--pairs {source}: no column {', '.join(missing)} (TRL's preference format: prompt, chosen, "
                         "rejected)")
    rows, cut = [], {"chosen": 0, "rejected": 0}
    for number, row in enumerate(data, 1):
        prompt = row["prompt"]
        if isinstance(prompt, list):  # conversational: the template as it is
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) if getattr(
                tokenizer, "chat_template", None) else "".join(m["content"] for m in prompt)
            question = prompt[-1]["content"]
        else:
            text, question = format_prompt(tokenizer, prompt, answer_format, instruction), prompt
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if (length := len(prompt_ids)) > max_prompt_length:
            raise ValueError(f"--pairs {source}: row {number}'s prompt has {length} tokens, over --max_prompt_length "
                             f"{max_prompt_length}: raise it, or leave the row out")
        out = {"prompt": text, "prompt_ids": prompt_ids, "question": question}
        for column in ("chosen", "rejected"):
            completion = row[column]
            content = completion[-1]["content"] if isinstance(completion, list) and completion else completion
            if not isinstance(content, str) or not content.strip():
                raise ValueError(f"--pairs {source}: row {number}'s {column} is empty: every pair needs both "
                                 "completions")
            ids = tokenizer(content, add_special_tokens=False)["input_ids"]
            cut[column] += len(ids) > max_completion_length - 1  # (room for the end-of-text token)
            out[column] = ids[:max_completion_length - 1] + [tokenizer.eos_token_id]
        rows.append(out)
    if not rows:
        raise ValueError(f"--pairs {source}: no rows")
    return rows, (f"pairs {source}: {len(rows)} rows; cut to --max_new_tokens: chosen {cut['chosen']}, "
                  f"rejected {cut['rejected']}")
