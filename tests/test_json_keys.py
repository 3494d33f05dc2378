"""The duplicate-key rule of :func:`protocol.validation.decode_json_body`, on generated bodies: no
body without a repeated key is refused (colons, quotes and escapes in strings included), and a key
repeated anywhere is found with its pointer."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import Unprocessable
from protocol.validation import decode_json_body

_text = st.text(alphabet=st.sampled_from(list('ab:"\\/~ \u00e9\n')), max_size=6)
_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_text, _json, max_size=5))
def test_bodies_without_a_repeated_key_are_read_as_sent(body: dict[str, Any]) -> None:
    for raw in (orjson.dumps(body), orjson.dumps(body, option=orjson.OPT_INDENT_2)):
        assert decode_json_body(raw) == body


def _pointer(path: list[str | int]) -> str:
    return "".join("/" + (str(p).replace("~", "~0").replace("/", "~1")) for p in path)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_text, _json, min_size=1, max_size=5), st.data())
def test_a_repeated_key_anywhere_is_refused_with_its_pointer(body: dict[str, Any], data: st.DataObject) -> None:
    # Pick an object inside the body (the body itself or one nested in it) and repeat one of its keys.
    objects: list[tuple[list[str | int], dict[str, Any]]] = []

    def walk(value: Any, path: list[str | int]) -> None:
        if isinstance(value, dict):
            if value:
                objects.append((path, value))
            for k, v in value.items():
                walk(v, [*path, k])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, [*path, i])

    walk(body, [])
    path, target = data.draw(st.sampled_from(objects))
    key = data.draw(st.sampled_from(sorted(target)))
    marker = "\u2603repeat\u2603"
    target[marker] = None
    raw = orjson.dumps(body).replace(orjson.dumps(marker), orjson.dumps(key), 1)
    with pytest.raises(Unprocessable) as caught:
        decode_json_body(raw)
    assert caught.value.code == "duplicate_key"
    # The only repeat in the body, so the first in document order.
    assert caught.value.extra["pointer"] == _pointer([*path, key])[:200]
