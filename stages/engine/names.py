"""What may name something in the store, checked wherever a name comes from outside it (a
remote cache's entry, a receipt's artifacts): a stage of the table, a key and a digest of their
exact hex form, a file path relative and inside its object. Each becomes a path under
artifacts/store, so none may lead out of it."""
from __future__ import annotations

import ntpath
import re

KEY = re.compile(r"[0-9a-f]{32}")  # keys.key_of: BLAKE3, 32 lowercase hex characters
DIGEST = re.compile(r"[0-9a-f]{64}")  # a whole BLAKE3 hexdigest
NAME_CAP = 255  # bytes in one path component: the longest file name Linux filesystems allow


def path_problem(rel: str) -> str | None:
    """Why rel cannot name a file inside an object, None where it can: a relative POSIX path,
    normalized, of printable characters, that no OS reads as absolute or on a drive."""
    if not rel.isprintable():  # NUL, newline, other control characters, unpaired surrogates
        return "holds an unprintable character"
    if "\\" in rel:
        return "holds a backslash"
    if rel.startswith("/") or ntpath.splitdrive(rel)[0]:
        return "is absolute or on a drive"
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, . or .. part"
    if any(len(part.encode()) > NAME_CAP for part in parts):
        return f"has a part longer than {NAME_CAP} bytes"
    return None


def named(stage, key, stages) -> bool:
    """Whether a (stage, key) read from the remote can name an entry: a stage of the stage table
    (`stages`) and a key of the form keys.key_of gives, so that neither can lead out of the store."""
    return isinstance(stage, str) and stage in stages and isinstance(key, str) and KEY.fullmatch(key) is not None


def is_digest(value) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None
