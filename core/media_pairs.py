"""A folder of media files with one JSON-lines index of (file, text) pairs: what
``audio_folder(path, ...)`` (``transcripts.jsonl``, ``{"audio": ..., "text": ...}``) and
``image_text_folder(path, ...)`` (``captions.jsonl``, ``{"image": ..., "text": ...}``) read.
Written once for every reader: check's validation and the ranks' read.

Each non-blank line of ``root/<index>`` is one JSON object whose media field names a file relative
to ``root`` (or absolute) and whose ``text`` is a non-empty string; the lines are the samples, in
order. Stdlib only.
"""

from __future__ import annotations

import json
import os

import attrs

__all__ = ["MediaError", "Pair", "read_pairs"]


class MediaError(ValueError):
    """An index or media file that is not what the folder source reads; `path` (and `line`,
    1-based, of the index) names it, `code` is check's diagnostic for it."""

    def __init__(self, path: str, why: str, line: int | None = None, code: str = ""):
        super().__init__(f"{path}{'' if line is None else f':{line}'}: {why}")
        self.path, self.why, self.line, self.code = path, why, line, code


@attrs.frozen
class Pair:
    media: str  # the media file's path, as opened
    text: str
    line: int  # its line in the index


def read_pairs(root: str, index: str, media: str, code: str, what: str) -> list[Pair]:
    """Every line of ``root/index``; MediaError(code) for a missing or malformed folder, file,
    line or field, or a ``media`` file (``what``: "audio file", "image") that is not a regular file."""
    path = os.path.join(root, index)
    if not os.path.isdir(root):
        raise MediaError(root, "does not exist or is not a folder", code=code)
    if not os.path.isfile(path):
        raise MediaError(path, f"there is no {index} (one {{\"{media}\": \"file\", \"text\": \"...\"}} per line)",
                         code=code)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MediaError(path, f"cannot be read as UTF-8 text: {exc}", code=code) from None
    pairs = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as exc:
            raise MediaError(path, f"not a JSON object: {exc}", n, code) from None
        if not isinstance(row, dict):
            raise MediaError(path, f"a JSON {type(row).__name__}, not an object", n, code)
        for key in (media, "text"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise MediaError(path, f"no '{key}' field (a non-empty string)" if key not in row
                                 else f"the '{key}' field is not a non-empty string", n, code)
        file = os.path.join(root, row[media])
        if not os.path.isfile(file):
            raise MediaError(path, f"the {what} {row[media]} does not exist (or is not a regular file)", n, code)
        pairs.append(Pair(file, row["text"], n))
    if not pairs:
        raise MediaError(path, f"holds no lines (one {{\"{media}\": \"file\", \"text\": \"...\"}} each)", code=code)
    return pairs
