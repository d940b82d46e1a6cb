"""Text that came from the wire, made safe for a message, a repr or a log line.

A payload's host and device names, a broker address or an option value are chosen by the sender.
Before any of them reaches a person they pass through :func:`safe`, so a sender cannot forge lines
of an error (a newline, ``\\r``), recolour or clear a terminal (ESC sequences) or reorder what is
shown (bidi marks).
"""

from __future__ import annotations

_MAX = 300  # longer text is cut: nothing on the wire is longer than 255 bytes


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
    ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``; an ordinary space stays. A non-``str`` value is
    shown through its ``repr``. Never raises.
    """
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    if len(text) > _MAX:
        text = text[:_MAX] + "..."
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
