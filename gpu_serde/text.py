"""Text that came from the wire, made safe for a message, a repr or a log line.

A payload's host and device names, a broker address or an option value are chosen by the sender.
Before any of them reaches a person they pass through :func:`safe` (or :func:`quoted`), so a
sender cannot forge lines of an error (a newline, ``\\r``), recolour or clear a terminal (ESC
sequences) or reorder what is shown (bidi marks). :func:`describe` shows any payload value without
running code of the sender's choosing (no foreign ``__repr__``).
"""

from __future__ import annotations

_MAX = 300  # longer text is cut: nothing on the wire is longer than 255 bytes
_ITEMS = 8  # items of a container that describe() shows
_PLAIN = (bool, int, float, type(None))


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def safe(value: object) -> str:
    """Return ``value`` as text with every character that is not printable escaped.

    Control characters (``\\n``, ``\\r``, ESC, DEL, C1 controls), format characters (bidi marks,
    zero-width joiners), line and paragraph separators and unassigned code points become
    ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``; an ordinary space stays. Text longer than 300
    characters is cut. A ``str`` subclass is read as the plain ``str`` it holds; any other value is
    shown by :func:`describe`. Never raises.
    """
    text = str.__str__(value) if isinstance(value, str) else describe(value)
    if len(text) > _MAX:
        text = text[:_MAX] + "..."
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def quoted(value: object) -> str:
    """:func:`safe` text in single quotes, a quote inside escaped: a name that cannot be taken
    for the words around it."""
    return "'" + safe(value).replace("'", "\\'") + "'"


def describe(value: object, depth: int = 2) -> str:
    """A short repr of a value from a payload that runs none of the value's own code: builtin
    bytes, str, numbers, None and (to ``depth``) tuples, lists and dicts are shown, anything else
    as ``<its type's name>``. Never raises for any value."""
    try:
        kind = type(value)
        if kind in _PLAIN:
            if kind is int and value.bit_length() > 64:  # type: ignore[attr-defined]
                return "<int>"
            return repr(value)
        if kind is str or kind is bytes:
            shown = repr(value[:60])  # type: ignore[index]
            return shown + "..." if len(value) > 60 else shown  # type: ignore[arg-type]
        if kind in (tuple, list) and depth > 0:
            items = [describe(v, depth - 1) for v in value[:_ITEMS]]  # type: ignore[index]
            more = ", ..." if len(value) > _ITEMS else ""  # type: ignore[arg-type]
            opened, closed = ("(", ")") if kind is tuple else ("[", "]")
            return opened + ", ".join(items) + more + closed
        if kind is dict and depth > 0:
            pairs = list(value.items())[:_ITEMS]  # type: ignore[attr-defined]
            items = [f"{describe(k, 0)}: {describe(v, depth - 1)}" for k, v in pairs]
            return "{" + ", ".join(items) + "}"
        return f"<{safe(type.__dict__['__name__'].__get__(kind))}>"
    except Exception:  # pragma: no cover - a type whose very name is hostile
        return "<object>"
