"""Signatures of thinking blocks: what the server gives each `thinking` block it sends, and checks on the way back.

Anthropic's clients send an assistant turn's thinking blocks back unchanged, with their `signature`, and a server
must be able to tell its own reasoning from text a client wrote or changed. A signature here is
`"mlxpd1." + base64url(HMAC-SHA256(key, thinking))` with the key derived from the served model's name, so any
router serving the same model (after a restart, or beside another in a cluster) verifies it. A block sent with its
text omitted (`thinking.display: "omitted"`) carries the text in its signature instead, after a second dot
(`"mlxpd1." + mac + "." + base64url(thinking)`), so the reasoning still reaches the template on the next turn.
It protects the block's integrity, not its secrecy (the reasoning is readable):

    a signature of this form that verifies       the reasoning is the model's: it goes back to the chat template
    a signature of this form that does not       400 naming the block: it was changed (send it back unchanged)
    another form (another server's, or empty)    the block is left out of the prompt, as a redacted_thinking
                                                 block is: this server cannot vouch for it
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Optional

PREFIX = "mlxpd1."


def _key(model: str) -> bytes:
    return hashlib.sha256(b"mlx-pd thinking signature\0" + model.encode("utf-8")).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(thinking: str, model: str, carry: bool = False) -> str:
    """The signature of reasoning text `thinking` produced by served model `model`; `carry`: the text travels in
    the signature (a block sent with empty text)."""
    mac = _b64(hmac.new(_key(model), thinking.encode("utf-8"), hashlib.sha256).digest())
    return PREFIX + mac + ("." + _b64(thinking.encode("utf-8")) if carry else "")


def is_ours(signature: str) -> bool:
    """The signature has this server's form (whether or not it verifies)."""
    return signature.startswith(PREFIX)


def verified_text(thinking: str, signature: str, model: str) -> Optional[str]:
    """The reasoning a block of this server's form vouches for: its `thinking`, or the text its signature carries
    when `thinking` is empty; None when the signature does not verify (the block was changed)."""
    body = signature[len(PREFIX):]
    mac, _, carried = body.partition(".")
    if carried and not thinking:
        try:
            thinking = _unb64(carried).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    expected = sign(thinking, model, carry=bool(carried)).removeprefix(PREFIX).partition(".")[0]
    return thinking if hmac.compare_digest(expected, mac) else None
