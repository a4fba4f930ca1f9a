"""load_problems on small files written here: verl-style parquet/jsonl, plain jsonl, broken rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vespo.data import load_problems, render_prompt
from vespo.types import Problem

VERL_ROWS = [
    {"data_source": "math500", "prompt": [{"role": "user", "content": "What is 1/2 + 1/4?"}],
     "reward_model": {"style": "rule", "ground_truth": "3/4"}, "extra_info": {"index": 7, "split": "test"}},
    {"data_source": "aime24", "prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "2+2?"}],
     "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 8, "split": "test"}},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_verl_parquet(tmp_path):
    path = tmp_path / "mix.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    problems = load_problems(path)
    assert [p.data_source for p in problems] == ["math500", "aime24"]
    assert problems[0].prompt == [{"role": "user", "content": "What is 1/2 + 1/4?"}]
    assert [p.ground_truth for p in problems] == ["3/4", "4"]
    assert problems[1].extra_info == {"index": 8, "split": "test"} and problems[1].id == "8"


def test_verl_jsonl_with_string_prompt_and_blank_lines(tmp_path):
    rows = [VERL_ROWS[0], "", {"data_source": "amc23", "prompt": "Compute 3*3.",
                               "reward_model": {"ground_truth": 9}}]
    problems = load_problems(write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(problems) == 2
    assert problems[1] == Problem(id="d-3", prompt="Compute 3*3.", ground_truth=9, data_source="amc23",
                                  extra_info={})


def test_plain_jsonl_prompt_answer(tmp_path):
    rows = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+1=", "answer": "2", "id": "x"}]
    problems = load_problems(write_jsonl(tmp_path / "arith.jsonl", rows))
    assert [(p.id, p.prompt, p.ground_truth, p.data_source) for p in problems] == [
        ("arith-1", "12+34=", "46", "arith"), ("x", "1+1=", "2", "arith")]


GOOD = {"prompt": "1+1=", "answer": "2"}


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ('{"prompt": "1+1=", "answer": ', r"row 2: not valid JSON"),
        ("[1, 2]", r"row 2: expected a JSON object, got list"),
        ({"answer": "2"}, r"row 2: field 'prompt' is missing"),
        ({"prompt": "  ", "answer": "2"}, r"row 2: field 'prompt' is empty"),
        ({"prompt": 5, "answer": "2"}, r"row 2: field 'prompt' must be a string or a non-empty list"),
        ({"prompt": [], "answer": "2"}, r"row 2: field 'prompt' must be a string or a non-empty list"),
        ({"prompt": [{"role": "user"}], "answer": "2"}, r"row 2: field 'prompt\[0\].content' must be a string"),
        ({"prompt": ["hi"], "answer": "2"}, r"row 2: field 'prompt\[0\]' must be a \{role, content\} object"),
        ({"prompt": "1+1="}, r"row 2: field 'reward_model.ground_truth' \(or 'answer'\) is missing"),
        ({"prompt": "1+1=", "reward_model": {"style": "rule"}}, r"row 2: field 'reward_model.ground_truth' is missing"),
        ({"prompt": "1+1=", "reward_model": "2"}, r"row 2: field 'reward_model' must be an object"),
        ({"prompt": "1+1=", "answer": ""}, r"row 2: the ground truth .* is empty"),
        ({"prompt": "1+1=", "answer": None}, r"row 2: the ground truth .* is empty"),
        ({"prompt": "1+1=", "answer": "2", "extra_info": [1]}, r"row 2: field 'extra_info' must be an object"),
        ({"prompt": "1+1=", "answer": "2", "data_source": 3}, r"row 2: field 'data_source' must be a string"),
        ({"prompt": "1+1=", "answer": "2", "id": "data-1"}, r"row 2: field 'id' 'data-1' repeats the id of row 1"),
    ],
)
def test_broken_jsonl_row_names_file_row_and_field(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, bad_row])
    with pytest.raises(ValueError, match=rf"data\.jsonl: {message}"):
        load_problems(path)


def test_broken_parquet_row_names_file_row_and_field(tmp_path):
    rows = [VERL_ROWS[0], {**VERL_ROWS[1], "reward_model": {"style": "rule", "ground_truth": None}}]
    path = tmp_path / "broken.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"broken\.parquet: row 2: the ground truth"):
        load_problems(path)


def test_missing_empty_and_unsupported_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl' does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the file has no rows"):
        load_problems(tmp_path / "empty.jsonl")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet: the file has no rows"):
        load_problems(tmp_path / "empty.parquet")
    (tmp_path / "garbage.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"garbage\.parquet: cannot read as parquet"):
        load_problems(tmp_path / "garbage.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        load_problems(tmp_path / "d.csv")


def test_render_prompt_plain_and_chat_template():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    problem = Problem(id="p", prompt=messages, ground_truth="4")
    assert render_prompt(Problem(id="s", prompt="12+34=", ground_truth="46")) == "12+34="
    assert render_prompt(problem) == "Be brief.\n2+2?"  # no tokenizer: contents joined

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    assert render_prompt(problem, tok) == "Be brief.\n2+2?"  # a tokenizer without a chat template
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_prompt(problem, tok) == "<system>Be brief.<user>2+2?<assistant>"
