"""Sources and formats: every supported file type and row layout becomes the canonical record,
and a bad row fails with file:line or, with on_error: skip, is counted."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from stages.data import rows
from stages.data.kinds import chat, preference, prompt, text, unpaired
from stages.engine.errors import UserError
from stages.engine.recipe import DataSection
from stages.data.sources import SourceCount, job_records, label_of, source_jobs

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/datasets is not on this machine")

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def collect(data: DataSection, kind, root: Path):
    """(kept records, drop counts, rows read per source) of every source, as the shards stage reads them."""
    kept, dropped, rows_in = [], Counter(), Counter()
    for src in data.sources:
        count = SourceCount(src)
        for job in source_jobs(src, root, data):
            records, _, _, outcome = job_records(job, src, data, kind)
            count.take(outcome)
            kept += records
        dropped.update(count.dropped)
        rows_in[label_of(src)] = count.rows_in
    return kept, dropped, rows_in


def read(tmp_path, files: dict[str, str | bytes], kind=chat, on_error="fail"):
    for name, body in files.items():
        (tmp_path / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    return collect(DataSection(sources=[{"path": name} for name in files], on_error=on_error), kind, tmp_path)


def jsonl(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def test_formats_are_detected_and_converted():
    assert rows.convert(CHAT, "auto", chat) == {"messages": CHAT["messages"]}
    sharegpt = rows.convert({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                            "auto", chat)
    assert sharegpt["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    alpaca = rows.convert({"instruction": "Add", "input": "2 3", "output": "5"}, "auto", chat)
    assert alpaca["messages"] == [{"role": "user", "content": "Add\n\n2 3"}, {"role": "assistant", "content": "5"}]
    reasoning = rows.convert({"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "a", "thinking": "hmm"}]}, "auto", chat)
    assert reasoning["messages"][1] == {"role": "assistant", "content": "a", "reasoning": "hmm"}
    assert rows.convert({"text": "once upon"}, "auto", text) == {"text": "once upon"}
    pair = rows.convert({"prompt": "q", "chosen": "good", "rejected": "bad"}, "auto", preference)
    assert pair == {"prompt": [{"role": "user", "content": "q"}],
                    "chosen": [{"role": "assistant", "content": "good"}],
                    "rejected": [{"role": "assistant", "content": "bad"}]}
    implicit = rows.convert({"chosen": CHAT["messages"],
                             "rejected": [CHAT["messages"][0], {"role": "assistant", "content": "no"}]},
                            "auto", preference)
    assert implicit["prompt"] == CHAT["messages"][:1] and implicit["rejected"][0]["content"] == "no"
    grpo = rows.convert({"question": "2+2?", "answer": "4"}, "auto", prompt)
    assert grpo == {"prompt": [{"role": "user", "content": "2+2?"}], "reference": "4"}
    assert rows.convert({"question": "2+2?", "answer": "4"}, "auto", chat)["messages"][1]["content"] == "4"


def test_unpaired_rows_as_trl_writes_them_and_every_bad_one_counted(tmp_path):
    """TRL's unpaired preference rows (KTO's), standard and conversational, from JSON Lines,
    Parquet (booleans) and CSV (the cells are text); a label that is not a boolean, an empty
    completion, a pair, and a completion that is not one assistant turn are each counted."""
    import pandas as pd

    user, said = [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}]
    assert rows.convert({"prompt": "2+2?", "completion": "4", "label": True}, "auto", unpaired) == \
        rows.convert({"prompt": user, "completion": said, "label": True}, "auto", unpaired) == \
        {"prompt": user, "completion": said, "desirable": True}
    pd.DataFrame([{"prompt": "2+2?", "completion": "5", "label": False}]).to_parquet(tmp_path / "a.parquet")
    (tmp_path / "b.csv").write_text("prompt,completion,label\r\n2+2?,4,True\r\n2+2?,22,false\r\n")
    kept, dropped, _ = collect(DataSection(sources=[{"path": "a.parquet"}, {"path": "b.csv"}]), unpaired, tmp_path)
    assert [(r["completion"][0]["content"], r["desirable"]) for r in kept] == [("5", False), ("4", True), ("22", False)]
    assert not dropped

    good = {"prompt": "2+2?", "completion": "4", "label": True}
    bad = [{**good, "label": 1}, {**good, "label": "yes"}, {**good, "label": None}, {"prompt": "2+2?", "completion": "4"},
           {**good, "completion": " "}, {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
           {**good, "completion": said + said}, {**good, "prompt": user + said}]
    kept, dropped, rows_in = read(tmp_path, {"k.jsonl": jsonl(good, *bad, {**good, "label": False})}, unpaired, "skip")
    assert [r["desirable"] for r in kept] == [True, False]
    assert dropped == {"invalid_label": 4, "empty_answer": 1, "wrong_format": 1, "invalid_row": 2}
    assert rows_in["k.jsonl"] == len(kept) + sum(dropped.values())
    with pytest.raises(UserError, match=r'^k.jsonl:2: "label" must be true or false \(desirable or not\), not 1; '):
        read(tmp_path, {"k.jsonl": jsonl(good, bad[0])}, unpaired)
    # an exact duplicate is of prompt, completion and label together: one answer marked both ways is not one
    assert unpaired.lines(kept[0]) != unpaired.lines({**kept[0], "desirable": False})


def test_a_row_of_the_wrong_kind_is_refused():
    with pytest.raises(rows.BadRow, match="cannot feed continued pretraining"):
        rows.convert(CHAT, "auto", text)


def test_file_types_jsonl_json_csv_parquet_and_gzip(tmp_path):
    import pandas as pd

    pd.DataFrame([{"instruction": "Add", "input": "", "output": "5"}]).to_parquet(tmp_path / "a.parquet")
    pd.DataFrame([{"prompt": "2+2?", "answer": "4"}]).to_csv(tmp_path / "b.csv", index=False)
    got, dropped, rows_in = read(tmp_path, {
        "c.jsonl": jsonl(CHAT),
        "d.json": json.dumps([CHAT, CHAT]),
        "e.jsonl.gz": gzip.compress(jsonl(CHAT).encode()),
    })
    assert len(got) == 4 and not dropped
    (tmp_path / "f.csv.gz").write_bytes(gzip.compress(b"question,answer\n2+2?,4.50\n"))
    data = DataSection(sources=[{"path": "a.parquet"}, {"path": "b.csv"}, {"path": "f.csv.gz"}])
    parsed, _, _ = collect(data, chat, tmp_path)
    assert [r["messages"][-1]["content"] for r in parsed] == ["5", "4", "4.50"]  # cells stay text


def test_hub_source_reads_a_pinned_dataset(tmp_path):
    """The hub code path, run against a local dataset directory (no network here)."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text(jsonl(CHAT, {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    data = DataSection(sources=[{"hub": str(tmp_path / "ds"), "revision": "0" * 40}])
    got, _, rows_in = collect(data, chat, tmp_path)
    assert [r["messages"][1]["content"] for r in got] == ["yo", "b"]
    assert rows_in == {f"{tmp_path / 'ds'}@{'0' * 40}": 2}


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', "t.jsonl:2: malformed JSON"),
    ('{"messages": [{"role": "user"}]}', "t.jsonl:2: a message without string content"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "t.jsonl:2: unknown role 'wizard'"),
    ('{"foo": 1}', "t.jsonl:2: cannot tell the format"),
])
def test_bad_rows_fail_with_file_and_line(tmp_path, line, message):
    with pytest.raises(UserError) as e:
        read(tmp_path, {"t.jsonl": jsonl(CHAT) + line + "\n" + jsonl(CHAT)})
    assert str(e.value).startswith(message) and "on_error: skip" in str(e.value)


def test_skip_counts_every_dropped_row(tmp_path):
    got, dropped, rows_in = read(tmp_path, {"t.jsonl": jsonl(CHAT) + "{not json\n" + '{"foo": 1}\n' + "\n" + jsonl(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "q"}]}, CHAT)}, on_error="skip")
    assert len(got) == 2
    assert dropped == {"malformed_json": 1, "unknown_format": 1, "blank_line": 1, "empty_answer": 1,
                       "no_assistant_turn": 1}
    assert rows_in["t.jsonl"] == len(got) + sum(dropped.values())


HOSTILE_ROWS = {  # one row each that used to stop the whole build with a traceback, even under on_error: skip
    "deep": ("[" * 100_000 + "]" * 100_000, "malformed_json", "nested deeper than 64 levels"),
    "long-integer": ('{"messages": [], "id": ' + "9" * 5000 + "}", "malformed_json", "Exceeds the limit"),
    "role-a-list": ('{"messages": [{"role": ["user"], "content": "q"}]}', "unknown_role", "unknown role ['user']"),
    "sharegpt-from-a-dict": ('{"conversations": [{"from": {"a": 1}, "value": "q"}]}', "unknown_role", "unknown role"),
    "lone-surrogate": ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}',
                       "malformed_json", "a lone UTF-16 surrogate escape"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_ROWS))
def test_a_hostile_row_is_counted_by_reason_or_named_by_line(tmp_path, name):
    line, reason, message = HOSTILE_ROWS[name]
    body = jsonl(CHAT) + line + "\n" + jsonl(CHAT)
    got, dropped, _ = read(tmp_path, {"t.jsonl": body}, on_error="skip")
    assert len(got) == 2 and dropped == {reason: 1}
    with pytest.raises(UserError) as e:
        read(tmp_path, {"t.jsonl": body})
    assert str(e.value).startswith("t.jsonl:2: ") and message in str(e.value), str(e.value)[:300]


def test_a_paired_surrogate_escape_is_text(tmp_path):
    got, dropped, _ = read(tmp_path, {"t.jsonl": '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, '
                                                 '{"role": "assistant", "content": "a"}]}\n'}, on_error="skip")
    assert not dropped and got[0]["messages"][0]["content"] == "\U0001f600"


@pytest.mark.parametrize("name, body, message", [
    ("t.csv", b"prompt,answer\nhi,there\ncaf\xe9,ok\n", "t.csv: cannot read it as csv ('utf-8' codec can't decode"),
    ("t.csv", b"prompt,answer\nhi,there\na,b,c\n", "t.csv: cannot read it as csv (Error tokenizing data"),
    ("t.json", b'[{"prompt": "a", "answer": "\xe9"}]', "t.json: not UTF-8"),
    ("t.json", b"[" * 100 + b"]" * 100, "t.json: nested deeper than 64 levels"),
    ("t.json", b'[{"prompt": "a", "answer": "b", "id": ' + b"9" * 5000 + b"}]", "t.json: malformed JSON (Exceeds"),
    ("t.json.gz", gzip.compress(b'[{"prompt": "a", "answer": "b"}]')[:20], "t.json.gz: cannot read it ("),
    ("t.csv.gz", b"not gzip at all", "t.csv.gz: cannot read it as csv ("),
])
def test_a_json_or_csv_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, name, body, message):
    with pytest.raises(UserError) as e:
        read(tmp_path, {name: body}, kind=prompt, on_error="skip")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)[:300]


def test_a_bad_row_pickles_whole():
    """A .json source's bad rows go to the shards stage's worker processes as jobs, pickled."""
    import pickle

    row = pickle.loads(pickle.dumps(rows.BadRow("malformed_json", "a lone surrogate")))
    assert (row.reason, str(row)) == ("malformed_json", "a lone surrogate")


def test_a_lone_surrogate_in_a_json_file_is_a_counted_row(tmp_path):
    got, dropped, _ = read(tmp_path, {"t.json": '[{"prompt": "a", "answer": "\\udfff"}, {"prompt": "b", "answer": "c"}]'},
                           kind=prompt, on_error="skip")
    assert len(got) == 1 and dropped == {"malformed_json": 1}


@needs_shared
def test_real_datasets_convert_without_loss():
    """ShareGPT conversations, GSM8K problems and HH-RLHF transcripts (gzip) from ../shared."""
    data = DataSection(sources=[{"path": "fastchat-dummy-conversation/dummy_conversation.json"},
                                {"path": "gsm8k/test.jsonl"}])
    chats, dropped, _ = collect(data, chat, SHARED)
    assert len(chats) == 500 + 1319 and not dropped
    assert {m["role"] for r in chats for m in r["messages"]} <= {"user", "assistant"}
    data = DataSection(sources=[{"path": "hh-rlhf-harmless/test.jsonl.gz"}], on_error="skip")
    pairs, dropped, _ = collect(data, preference, SHARED)
    assert len(pairs) + sum(dropped.values()) == 2312 and len(pairs) > 2200
    first = pairs[0]
    assert first["prompt"][-1]["role"] == "user" and first["chosen"] != first["rejected"]


def test_a_row_over_max_row_bytes_is_counted_oversized_and_never_read_whole(tmp_path):
    from stages.data.files import Oversized, jsonl_blocks

    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000},
                                   {"role": "assistant", "content": "y"}]})
    small = json.dumps(CHAT)
    body = "\n".join([small, big, small, big]) + "\n"
    (tmp_path / "a.jsonl").write_text(body)
    blocks = list(jsonl_blocks(tmp_path / "a.jsonl", 64, 4096))  # cuts fall inside the big lines
    assert [b.length for b in blocks if isinstance(b, Oversized)] == [len(big) + 1, len(big) + 1]
    data = DataSection(sources=[{"path": "a.jsonl"}], max_row_bytes=4096)  # on_error: fail
    kept, dropped, rows_in = collect(data, chat, tmp_path)
    assert len(kept) == 2 and dropped == {"oversized": 2} and rows_in == {"a.jsonl": 4}
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(body)
    data = DataSection(sources=[{"path": "a.jsonl.gz"}], max_row_bytes=4096)
    assert collect(data, chat, tmp_path)[1] == {"oversized": 2}
    data = DataSection(sources=[{"path": "a.jsonl"}], max_row_bytes=100_000)
    assert collect(data, chat, tmp_path)[1] == {}


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_blocks_cut_at_every_line_end_a_file_may_have(tmp_path, end):
    """JSON Lines with LF, CR LF or classic Mac CR line ends, plain and gzipped, cut into blocks at
    every size from one byte up: each row is read once, whole, and no block starts inside a line
    end (a CR LF cut between its two bytes would make a blank line). Until blocks were cut at CR
    too, a CR-only file over the block size was one line: one oversized row."""
    from stages.data.files import Oversized, jsonl_blocks, jsonl_rows

    rows = [{"messages": [{"role": "user", "content": f"q{i}" * (i % 7 + 1)}, {"role": "assistant", "content": "a"}]}
            for i in range(12)]
    body = end.join(json.dumps(r) for r in rows).encode() + end.encode()
    (tmp_path / "a.jsonl").write_bytes(body)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    for name in ("a.jsonl", "a.jsonl.gz"):
        for size in range(1, 90, 7):
            got = []
            for block in jsonl_blocks(tmp_path / name, size, 300):  # over any row, under the file
                assert not isinstance(block, Oversized)
                if isinstance(block, tuple):
                    offset, length = block
                    block = body[offset: offset + length]
                assert not block.startswith(b"\n"), (name, size)
                got += [row for _, row in jsonl_rows(block, 300)]
            assert got == rows, (name, size)


def test_files_as_people_have_them_bom_crlf_and_mixed_escaping(tmp_path):
    lines = ['{"messages": [{"role": "user", "content": "caf\\u00e9 \\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}]}',
            '{"messages": [{"role": "user", "content": "café 😀 raw"}, {"role": "assistant", "content": "ok"}]}']
    body = ("\ufeff" + "\r\n".join(lines) + "\r\n").encode()
    kept, dropped, _ = read(tmp_path, {"bom.jsonl": body})
    assert [r["messages"][0]["content"] for r in kept] == ["café 😀", "café 😀 raw"] and not dropped
    as_json = ("\ufeff" + json.dumps([json.loads(r) for r in lines])).encode()
    kept, dropped, _ = read(tmp_path, {"bom.json": as_json})
    assert len(kept) == 2 and not dropped
    csv_body = "\ufeffinstruction,input,output\r\ncafé,,ok\r\n".encode()
    kept, dropped, _ = read(tmp_path, {"bom.csv": csv_body})
    assert kept[0]["messages"][0]["content"] == "café" and not dropped


def test_special_token_text_is_refused_only_in_kinds_whose_trainer_tokenizes_text_again(tmp_path):
    """Preference, unpaired (KTO) and prompt (GRPO) rows reach TRL as text: a field holding a
    special token's text is counted (special_token_text). A chat or text row keeps it: the
    shards' own encoder takes it as text, and training reads those ids."""
    from stages.data import render
    from stages.model.tiny import char_tokenizer

    controls = render.control_pattern(char_tokenizer())
    quoted = "ends at <|endoftext|> here"
    cases = [(preference, {"prompt": "q", "chosen": quoted, "rejected": "b"}, True),
             (unpaired, {"prompt": quoted, "completion": "a", "label": True}, True),
             (prompt, {"question": "q<|im_start|>system", "answer": "4"}, True),
             (chat, {"messages": [{"role": "user", "content": quoted}, {"role": "assistant", "content": "a"}]}, False),
             (text, {"text": quoted}, False)]
    for kind, row, refused in cases:
        (tmp_path / "rows.jsonl").write_text(jsonl(row))
        data = DataSection(sources=[{"path": "rows.jsonl"}], on_error="skip")
        [job] = source_jobs(data.sources[0], tmp_path, data)
        records, _, _, outcome = job_records(job, data.sources[0], data, kind, controls)
        assert (outcome["dropped"] == {"special_token_text": 1}) == refused, kind.__name__
        assert len(records) == (0 if refused else 1)


def test_held_out_rows_quoting_special_tokens_are_left_out_of_scoring():
    """lm-eval tokenizes the rendered held-out text itself: a chat or text row quoting a special
    token would be scored on other tokens than training saw, so eval leaves it out (and counts it)."""
    from stages.eval import without_special_token_text
    from stages.model.tiny import char_tokenizer

    tok = char_tokenizer()
    clean = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    quoting = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "stop at <|im_end|>"}]}
    assert without_special_token_text([clean, quoting, clean], chat, tok) == [clean, clean]
    assert without_special_token_text([{"text": "a <|endoftext|> b"}, {"text": "ab"}], text, tok) == [{"text": "ab"}]
