"""The thinking options of an Anthropic Messages request: `thinking` (how the model reasons) and
`context_management` (context edits on earlier turns' reasoning). What they do is router/anthropic/endpoints.py's
translation (router/reasoning.py turns it into the template's switch and the engine's budget)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class ThinkingParam(BaseModel):
    """`thinking`: "enabled" (with `budget_tokens`, the most reasoning tokens: the engine ends the reasoning
    there), "adaptive" and "between_tools" (the model decides), "disabled" (the chat template's switch off,
    where it has one). `display` "omitted" sends thinking blocks with empty text (and their signature)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(None, ge=0)
    display: Optional[Literal["summarized", "omitted"]] = None

    @model_validator(mode="after")
    def _budget(self) -> "ThinkingParam":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens: thinking of type \"enabled\" needs budget_tokens, the most tokens "
                             "to think (or send {\"type\": \"adaptive\"})")
        return self


class ClearThinkingEdit(BaseModel):
    """`context_management.edits[]` of type clear_thinking_20251015: drop the reasoning of older assistant
    turns, keeping the last `keep` turns' ("all", or {"type": "thinking_turns", "value": N})."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["clear_thinking_20251015"]
    keep: Union[Literal["all"], dict[str, Any]] = Field(default_factory=lambda: {"type": "thinking_turns",
                                                                                 "value": 1})

    @field_validator("keep")
    @classmethod
    def _keep(cls, value: Any) -> Any:
        if isinstance(value, dict) and not (value.get("type") == "all" or (
                value.get("type") == "thinking_turns" and isinstance(value.get("value"), int)
                and not isinstance(value.get("value"), bool) and value["value"] >= 0)):
            raise ValueError("must be \"all\", {\"type\": \"all\"} or {\"type\": \"thinking_turns\", "
                             "\"value\": N} with N >= 0")
        return value

    @property
    def keep_turns(self) -> Optional[int]:
        """How many of the last assistant turns keep their reasoning (None: all)."""
        if self.keep == "all" or self.keep.get("type") == "all":
            return None
        return int(self.keep["value"])


def _edit(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "clear_thinking_20251015":
        raise PydanticCustomError("unsupported_edit", "context edits of type '{kind}' are not run by this server "
                                  "(it would change what the model sees): send only clear_thinking_20251015 edits, "
                                  "or leave the edit out and shorten the conversation", {"kind": str(kind)})
    return value


class ContextManagementParam(BaseModel):
    """`context_management`: the context edits to apply before the model reads the conversation."""

    model_config = ConfigDict(extra="ignore")

    edits: list[Annotated[ClearThinkingEdit, BeforeValidator(_edit)]] = []
