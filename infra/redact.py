"""Passwords kept out of what the product shows and logs: a URL's, wherever it sits.

One list of the query parameters that hold a secret (libpq takes ``password`` and ``sslpassword``
in a connection URL's query as well as in its user-info part) serves both guards: :func:`redact_url`
for a URL the code holds (configuration shown by ``doctor``, a store's or broker's description),
and :func:`redact_line` for a finished log line, the last guard for what a library writes into its
own messages.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

#: Query parameters of a connection URL that hold a secret, compared with the name decoded.
SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def hidden_userinfo(url: str) -> bool:
    """Whether ``url`` has an ``@`` past the end of its authority while its authority has none: the
    sign of a password holding an unencoded ``/``, ``?`` or ``#`` (``postgresql://tm:ab/cd@db/tm``),
    which URL parsers read as a port or a path, so that no password is found to hide."""
    _, sep, rest = url.partition("://")
    if not sep:
        return False
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    # An empty authority (``postgresql:///db?user=a@b``) has no password to lose.
    return 0 < end and "@" not in rest[:end] and "@" in rest[end:]


def redact_url(url: str) -> str:
    """Replace the password of a URL with ***: in its user-info part and in a secret query
    parameter (its name percent-encoded too; its value up to the next ``&``, as the drivers split
    it). The rest is left as written. A URL whose password holds an unencoded ``/``, ``?`` or ``#``
    (:func:`hidden_userinfo`) has everything from ``://`` to its last ``@`` replaced."""
    if hidden_userinfo(url):
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    parts = urlsplit(url)
    out = url
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        out = out.replace(parts.netloc, netloc, 1)
    if parts.query:
        pieces = []
        for piece in parts.query.split("&"):
            name, equals, _value = piece.partition("=")
            pieces.append(f"{name}=***" if equals and unquote(name).lower() in SECRET_PARAMETERS else piece)
        query = "&".join(pieces)
        if query != parts.query:
            out = out.replace("?" + parts.query, "?" + query, 1)
    return out


def _spelled(name: str) -> str:
    """A pattern for ``name`` with any of its letters percent-encoded, in either case (matched
    ignoring case, as :func:`redact_url` compares the decoded name)."""
    return "".join(f"(?:{re.escape(c)}|%{ord(c.lower()):02x}|%{ord(c.upper()):02x})" for c in name)


#: A URL's password (``scheme://user:password@``), wherever a line holds one; up to the ``@`` even
#: past a ``/``, ``?`` or ``#`` (a password holding one unencoded: see :func:`hidden_userinfo`).
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s@]+@")
#: A secret query parameter, wherever a line holds one (its value up to ``&``, ``#``, a space or a quote).
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&](?:" + "|".join(_spelled(n) for n in sorted(SECRET_PARAMETERS)) + r")=)[^&#\s'\"]*",
    re.IGNORECASE)


def redact_line(line: str) -> str:
    """``line`` with every URL password in it replaced by ***."""
    return _SECRET_PARAMETER.sub(r"\g<name>***", _URL_PASSWORD.sub(r"\g<head>***@", line))
