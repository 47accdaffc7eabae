"""A snapshot's trainer state log, copied and encoded once per entry ([Note: lists encoded once]).

The reference is ``json.dumps`` of the same values and the JSON round trip of the whole log that
each snapshot made before: the same text, the same copies, over a growing log, a log replaced by
another (a resume) and values that are not JSON.
"""

import json
import math

import pytest

from hf_lowzero.snapshot.json_text import EncodedList, dumps
from hf_lowzero.trainer.snapshot_files import LogCopies


def _entry(step: int) -> dict:
    return {"loss": 5.4 - step / 7, "learning_rate": 1e-3 / (step + 1), "step": step, "note": f'"{step}"\n'}


def test_a_manifest_with_encoded_lists_is_json_dumps_of_the_same_values():
    log = EncodedList()
    log.extend_copied([_entry(i) for i in range(3)])
    empty = EncodedList()
    manifest = {
        "step": 3,
        "trainer_state": {"global_step": 3, "log_history": log, "other": [1, 2], "empty": empty},
        "text": "hf_lowzero-encoded-list-",  # the token's prefix, in a user's text
        "records": {"a": {"shape": [2, 3]}},
    }
    plain = json.loads(json.dumps(manifest))
    assert dumps(manifest) == json.dumps(plain)
    assert json.loads(dumps(manifest)) == plain


def test_log_copies_copy_each_entry_once_and_equal_the_whole_round_trip():
    copies, log = LogCopies(), []
    seen = []
    for step in range(5):
        log.append(_entry(step))
        copy = copies.of(log)
        assert copy == json.loads(json.dumps(log)) and copy.text == json.dumps(log)
        seen.append(copy)
    assert seen[1] == json.loads(json.dumps(log[:2]))  # an earlier snapshot's copy did not grow
    assert seen[4][0] is seen[2][0]  # copied once, shared by the snapshots
    replaced = [*log[:4], _entry(40), _entry(5)]  # the same first entry, another where the copy ended
    assert copies.of(replaced).text == json.dumps(replaced)
    other = [_entry(10), _entry(11)]  # another log (a resume): copied from its start
    assert copies.of(other).text == json.dumps(other)
    with pytest.raises(ValueError, match="the trainer state's log is not JSON"):
        copies.of([*other, {"loss": math.nan, "bad": object()}])
    assert copies.of(other).text == json.dumps(other)  # the failed entry left nothing behind
