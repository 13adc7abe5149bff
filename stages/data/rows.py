"""Rows as the training methods consume them, whatever format users bring: each raw row (read
by stages/data/files.py) is detected as one format (or the source says which: `format:`) and
converted by the recipe's data kind (stages/data/kinds/) to that kind's canonical record. Here:
the formats, and the helpers the kinds share (messages, a chat from any chat-like format, the
lines cleaning reads of a conversation).

    format      a raw row's fields                                  feeds the kinds
    chat        messages (or ShareGPT's conversations)              chat, prompt
    alpaca      instruction, input, output                          chat, prompt
    prompt      prompt/question/query + reference/answer/...        chat, prompt
    preference  prompt?, chosen, rejected                           preference
    text        text                                                text

A row that cannot be converted raises BadRow with a reason (the drop-count key) and a message;
one the model's chat template refuses becomes Refused. The caller fails with file:line or
counts it (on_error: skip).
"""
from __future__ import annotations

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")
PROMPT_KEYS = ("prompt", "question", "query")
ANSWER_KEYS = ("reference", "answer", "completion", "response", "solution")


class BadRow(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # pickled whole: a worker process gets a source's bad rows as jobs
        return type(self), (self.reason, str(self))


class Refused(Exception):
    """The chat template raised an error for a conversation (a role it does not take, turns
    that do not alternate...): the row is bad, as a malformed one is."""

    def __init__(self, error: Exception):
        super().__init__(" ".join(str(error).split()))  # one line


def detect(row: dict) -> str:
    if "messages" in row or "conversations" in row:
        return "chat"
    if "chosen" in row and "rejected" in row:
        return "preference"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if any(k in row for k in PROMPT_KEYS) and any(k in row for k in ANSWER_KEYS):
        return "prompt"
    if "text" in row:
        return "text"
    raise BadRow("unknown_format", f"cannot tell the format from the keys {sorted(row)[:6]}; "
                                   f"set format in the source")


def text_field(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise BadRow("missing_field", f'"{key}" must be a string')
    return value


def first_field(row: dict, keys: tuple[str, ...]) -> str:
    return text_field(row, next((k for k in keys if k in row), keys[0]))


def message(m) -> dict:
    if not isinstance(m, dict):
        raise BadRow("invalid_message", "a message is an object with role and content")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if not isinstance(role, str) or role not in SHAREGPT_ROLES:  # (a list is no role, nor a dict key)
        raise BadRow("unknown_role", f"unknown role {role!r} (use one of {sorted(ROLES)})")
    if not isinstance(content, str):
        raise BadRow("missing_field", "a message without string content")
    out = {"role": SHAREGPT_ROLES[role], "content": content}
    reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str) and m[k]), None)
    if reasoning is not None:
        out["reasoning"] = reasoning
    return out


def messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow("missing_field", "messages must be a non-empty list")
    return [message(m) for m in value]


def as_chat(row: dict, fmt: str) -> list[dict]:
    """The conversation of a chat, alpaca or prompt row."""
    if fmt == "chat":
        return messages(row.get("messages", row.get("conversations")))
    if fmt == "alpaca":
        instruction, extra = text_field(row, "instruction"), row.get("input") or ""
        if not isinstance(extra, str):
            raise BadRow("missing_field", '"input" must be a string')
        chat = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
        chat.append({"role": "user", "content": instruction + ("\n\n" + extra if extra.strip() else "")})
        return chat + [{"role": "assistant", "content": text_field(row, "output")}]
    if fmt == "prompt":
        return [{"role": "user", "content": first_field(row, PROMPT_KEYS)},
                {"role": "assistant", "content": first_field(row, ANSWER_KEYS)}]
    raise BadRow("wrong_format", f"a {fmt} row cannot be a chat example")


def convert(row, fmt: str, kind) -> dict:
    """The raw row as the canonical record of `kind` (a module of stages/data/kinds/), from its
    format as the source names it or as detected."""
    if not isinstance(row, dict):
        raise BadRow("invalid_row", "a row is a JSON object")
    return kind.convert(row, detect(row) if fmt == "auto" else fmt)


def turns(messages: list[dict], answers: bool | None = None, head: str = "") -> list[tuple[str, str, bool]]:
    """A conversation as the lines cleaning reads (a kind's lines(record)): (prefix, text, is an
    answer) per turn, the prefix its role (after `head` on the first); the answers are the
    assistant turns, or all turns or none where `answers` says so."""
    return [(head * (i == 0) + m["role"] + ":", m["content"], m["role"] == "assistant" if answers is None else answers)
            for i, m in enumerate(messages)]
