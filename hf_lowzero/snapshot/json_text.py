"""JSON text of a manifest whose long lists are encoded once, not at every snapshot.

Example::

    log = EncodedList()
    log.extend_copied(new_entries)                    # each entry copied and encoded once, as it arrives
    dumps({"trainer_state": {"log_history": log}})    # == json.dumps(...), without encoding log again

# [Note: lists encoded once]
# Rank 0's piece describes the Trainer's state, whose log grows by an entry per logged step: at the
# main job's step 480 (a log entry per step) its JSON is 77 kB, and encoding it took about 1 ms of
# the background thread at every snapshot, more the longer the run. The entries already logged do
# not change (the Trainer appends), so the trainer state's copy keeps each entry's JSON text from
# the snapshot that first saw it (``EncodedList``), and ``dumps`` writes the list's text in place of
# the list: the same bytes as ``json.dumps``, each entry encoded once. Only lists that are values
# of the manifest's top-level dicts are looked at (the trainer state's ``log_history``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

_TOKEN = f"hf_lowzero-encoded-list-{uuid.uuid4().hex}"  # never in a user's text


class EncodedList(list):
    """A list of JSON values that also keeps its JSON text (``text``), one entry's text each."""

    def __init__(self) -> None:
        super().__init__()
        self._texts: list[str] = []

    def extend_copied(self, values: list[Any]) -> None:
        """Append JSON copies of ``values`` and their JSON text, each value encoded once; nothing is
        appended when one is not JSON (``TypeError`` or ``ValueError``)."""
        texts = [json.dumps(v) for v in values]
        self.extend(json.loads(t) for t in texts)
        self._texts.extend(texts)

    def copy_encoded(self) -> EncodedList:
        """A new list of the same entries and texts (shared, not copied)."""
        out = EncodedList()
        out.extend(self)
        out._texts = list(self._texts)
        return out

    @property
    def text(self) -> str:
        """``json.dumps(self)``."""
        return "[" + ", ".join(self._texts) + "]"


def dumps(value: dict[str, Any]) -> str:
    """``json.dumps(value)``, with the text of each ``EncodedList`` that is a value of ``value``'s
    dicts (one level down) spliced in ([Note: lists encoded once])."""
    texts: dict[str, str] = {}

    def token_for(lst: EncodedList) -> str:
        token = f"{_TOKEN}-{len(texts)}"
        texts[json.dumps(token)] = lst.text
        return token

    shallow = {}
    for key, inner in value.items():
        if isinstance(inner, dict) and any(isinstance(v, EncodedList) for v in inner.values()):
            inner = {k: token_for(v) if isinstance(v, EncodedList) else v for k, v in inner.items()}
        shallow[key] = inner
    text = json.dumps(shallow)
    for token, spliced in texts.items():
        text = text.replace(token, spliced, 1)
    return text
