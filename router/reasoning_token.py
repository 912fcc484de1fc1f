"""This server's token of a thinking model's reasoning: made when an answer carries reasoning, checked when a
client sends it back. One token serves both APIs that round-trip reasoning:

- Responses: a reasoning item's `encrypted_content` (OpenAI's clients with `store: false`, Codex, ask for it with
  `include: ["reasoning.encrypted_content"]` and send every reasoning item back in the next `input`);
- Anthropic Messages: a thinking block's `signature` (Claude Code sends the blocks back unchanged; with
  `thinking.display: "omitted"` the block's text is empty and the token alone carries it).

So the reasoning can reach the model again without the server keeping anything. A token of this server is

    "mlxpd1." + base64url(reasoning text, UTF-8) + "." + base64url(HMAC-SHA256(key, "mlxpd1." + that text part))

(base64url without padding), the key derived from the served model's name, so any router serving the same model
(after a restart, or beside another in a cluster) reads it. It protects the text's integrity, not its secrecy:

    a token of this form that verifies          its text is the model's reasoning (`read_token` returns it)
    a token of this form that does not          `TokenChanged`: the item was changed (the door answers 400)
    another form (OpenAI's, another server's)   None: the item's reasoning cannot be read and is left out
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Optional

PREFIX = "mlxpd1."


class TokenChanged(ValueError):
    """A token of this server's form whose MAC does not match its text."""


def _key(model: str) -> bytes:
    return hashlib.sha256(b"mlx-pd reasoning\0" + model.encode("utf-8")).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(signed: str, model: str) -> str:
    return _b64(hmac.new(_key(model), signed.encode("utf-8"), hashlib.sha256).digest())


def make_token(text: str, model: str) -> str:
    """The `encrypted_content` that carries reasoning `text` of served model `model`."""
    signed = PREFIX + _b64(text.encode("utf-8"))
    return signed + "." + _mac(signed, model)


def is_ours(token: str) -> bool:
    """The token has this server's form (whether or not it verifies)."""
    return token.startswith(PREFIX)


def read_token(token: str, model: str) -> Optional[str]:
    """The reasoning text `token` carries when it is this server's and verifies for `model`; None for a token of
    another form; `TokenChanged` for one of this form that does not verify."""
    if not is_ours(token):
        return None
    signed, _, mac = token.rpartition(".")
    if not signed.startswith(PREFIX) or not hmac.compare_digest(_mac(signed, model).encode("utf-8"),
                                                                    mac.encode("utf-8")):
        raise TokenChanged("it was changed after this server sent it (or comes from a server of another model): "
                           "send it back unchanged, or leave it out")
    try:
        return _unb64(signed[len(PREFIX):]).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):  # a MAC that verifies over text we never made
        raise TokenChanged("it does not decode: send it back unchanged, or leave it out") from None
