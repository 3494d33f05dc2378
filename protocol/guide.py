"""The usage guide as data: what an operator may store, the guide served when none is stored, ETags.

``GET /guide`` serves one Markdown document with a version. The operator replaces it with
``toastmachine guide set FILE``; nothing else writes it. These are the pure rules around it:

- :func:`parse_guide_file` turns the bytes of an operator's file into the text to store, or raises
  :class:`GuideRejected` saying exactly what is wrong (the CLI exits 2 with that message);
- :func:`builtin_guide` is the guide of a corpus whose operator never set one
  (:data:`protocol.agents.DEFAULT_GUIDE` at :data:`protocol.agents.GUIDE_VERSION`);
- :func:`guide_etag` names one representation of one guide version for HTTP validators.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from datetime import datetime

from protocol.agents import DEFAULT_GUIDE, GUIDE_VERSION
from protocol.errors import ToastMachineError

#: Longest guide, in characters (the ``guide.content`` column's check).
GUIDE_MAX_CHARS = 200_000
#: Media type of the guide's source text (the ``format`` field of the JSON answer).
GUIDE_FORMAT = "text/markdown"
_BOM = "\ufeff"


class GuideRejected(ToastMachineError):
    """An operator's file cannot become the guide; the message says why and where."""


@dataclass(frozen=True, slots=True)
class Guide:
    """One version of the guide.

    ``updated_at`` is when the operator stored it, or None for the built-in guide (never stored).
    """

    content: str
    version: int
    updated_at: datetime | None = None

    @property
    def builtin(self) -> bool:
        """Whether this is the built-in default guide rather than a stored one."""
        return self.updated_at is None


def builtin_guide() -> Guide:
    """The guide served while the ``guide`` table has no row."""
    return Guide(content=DEFAULT_GUIDE, version=GUIDE_VERSION)


def parse_guide_file(data: bytes) -> str:
    """The guide text in ``data``: UTF-8 Markdown, checked and normalised for storage.

    A leading byte-order mark is dropped and CRLF line endings become LF (both are editor habits, not
    content). Raises :class:`GuideRejected` when the file is not UTF-8, is empty or blank, is longer
    than :data:`GUIDE_MAX_CHARS` characters, or holds NUL or another control character other than
    newline and tab (the message gives its line and column).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise GuideRejected(f"the file is not valid UTF-8 (byte {e.start}, line {line}): "
                            "save it as UTF-8 text") from None
    text = text.removeprefix(_BOM).replace("\r\n", "\n")
    if not text.strip():
        raise GuideRejected("the file is empty: a guide needs some text")
    if len(text) > GUIDE_MAX_CHARS:
        raise GuideRejected(f"the file has {len(text):,} characters; a guide may have at most {GUIDE_MAX_CHARS:,}")
    for index, ch in enumerate(text):
        if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cs"):
            line = text.count("\n", 0, index) + 1
            column = index - (text.rfind("\n", 0, index) + 1) + 1
            name = "NUL" if ch == "\x00" else f"U+{ord(ch):04X}"
            raise GuideRejected(f"line {line}, column {column}: control character {name}; "
                                "only newline and tab are allowed")
    return text


def guide_etag(guide: Guide, representation: str) -> str:
    """A strong ETag for ``representation`` (e.g. ``json``, ``markdown``, ``html``) of ``guide``.

    The version alone would do for stored guides, whose versions only grow; a digest of the text is
    folded in so that a release changing the built-in text without bumping its version still changes
    the tag.
    """
    digest = hashlib.sha256(guide.content.encode("utf-8")).hexdigest()[:16]
    return f'"guide-{guide.version}-{digest}-{representation}"'
