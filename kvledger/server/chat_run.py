"""One chat request from its checked body to the engine and back, for the endpoints that speak
other wire formats over the chat path (/v1/messages, /v1/responses): the same template, tool
choice, structured outputs, tool parsing and streaming as /v1/chat/completions, so that they
cannot drift from it. ``prepare_chat`` is what /v1/chat/completions runs too; ``ChatRun``
drives one choice (these APIs have no ``n``) and hands back content and tool-call pieces as
they form, or the whole answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from kvledger.engine.front import RequestStream
from kvledger.outputs import RequestOutput
from kvledger.sampling_params import RequestOutputKind, SamplingParams
from kvledger.server.errors import APIError, validation_message
from kvledger.server.fields import FieldError
from kvledger.server.protocol import ChatCompletionRequest, UsageInfo
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import until_disconnect, usage_of
from kvledger.server.tool_stream import ToolCallStream, tool_message
from kvledger.server.tools import ToolCall, ToolChoice, chat_constraint

MAX_MESSAGES = 4096  # a chat request's messages (the body limit bounds them too)


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A translated request (Anthropic's, the Responses API's) as a chat request; its
    validation errors are the client's 400, naming the chat field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise FieldError(validation_message(e.errors())) from None


@dataclass
class PreparedChat:
    params: SamplingParams
    tool_choice: ToolChoice
    prompt: str
    add_special_tokens: bool


def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """The checked sampling params, tool choice (grammar set on the params) and rendered
    prompt of a chat request; every refusal is a 400 naming the problem."""
    ctx.check_model(body.model)
    params = body.to_sampling_params(ctx.sampling_defaults)
    cfg = ctx.config
    auto_tools = cfg.enable_auto_tool_choice and cfg.tool_call_parser is not None
    tool_choice = chat_constraint(body, params, cfg.structured_outputs_config, auto_tools)
    params.output_kind = RequestOutputKind.DELTA  # the engine sends only what is new
    ctx.check_params(params)
    if len(body.messages) > MAX_MESSAGES:
        raise APIError(400, f"at most {MAX_MESSAGES} messages", param="messages")
    prompt = ctx.render_chat(
        body.conversation(),
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        body.tools,
    )
    add_special = body.add_special_tokens
    if add_special is None:
        bos = getattr(ctx.tokenizer, "bos_token", None)
        add_special = not (bos and prompt.startswith(bos))  # the template wrote BOS itself
    return PreparedChat(params, tool_choice, prompt, add_special)


@dataclass
class Piece:
    """What one engine step added to the answer."""

    content: str  # text known to be content
    tool_calls: list[dict[str, Any]]  # OpenAI's delta.tool_calls fragments
    finish_reason: str | None  # set on the last piece (OpenAI's: stop, length, tool_calls)
    stop_reason: int | str | None = None  # the stop string or token that ended it


@dataclass
class Answer:
    """A finished choice: what /v1/chat/completions would put in its message."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    stop_reason: int | str | None
    usage: UsageInfo


@dataclass
class ChatRun:
    """One admitted chat request with a single choice."""

    ctx: ServingContext
    prepared: PreparedChat
    stream: RequestStream
    last: RequestOutput | None = field(default=None, init=False)

    @classmethod
    async def start(
        cls, ctx: ServingContext, body: ChatCompletionRequest, rid: str, priority: int = 0
    ) -> ChatRun:
        if body.n != 1:
            raise APIError(400, "this endpoint answers with one choice", param="n")
        prepared = prepare_chat(ctx, body)
        (stream,) = await ctx.add_all(
            [prepared.prompt], prepared.params, rid, priority, prepared.add_special_tokens
        )
        return cls(ctx, prepared, stream)

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.prompt_token_ids)

    def abort(self) -> None:
        self.stream.abort()

    def usage(self) -> UsageInfo:
        return usage_of([self.last], [self.prompt_tokens])

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer as it forms; engine errors propagate (the caller renders them)."""
        choice, parser = self.prepared.tool_choice, self.ctx.config.tool_call_parser
        tools = ToolCallStream(choice, parser) if choice.mode != "none" else None
        async for out in self.stream:
            self.last = out
            c = out.outputs[0]
            finished = c.finish_reason is not None
            if tools is not None:
                content, fragments, finish = tools.step(c.text, c.finish_reason if finished else None)
            else:
                content, fragments, finish = c.text, [], c.finish_reason
            if content or fragments or finished:
                yield Piece(content, fragments, finish, c.stop_reason if finished else None)

    async def answer(self, request: Request | None) -> Answer | None:
        """The whole answer; None when the client left first (the request is aborted).
        Without a request (a background response) nobody can leave: cancel the caller's task."""
        try:
            if request is None:
                outs = await self.ctx.final_outputs([self.stream])
            else:
                outs = await until_disconnect(request, self.ctx.final_outputs([self.stream]))
        finally:
            self.abort()  # a no-op for a finished request
        if outs is None:
            return None
        (out,) = outs
        self.last = out
        c = out.outputs[0]
        choice, parser = self.prepared.tool_choice, self.ctx.config.tool_call_parser
        content, calls, finish = tool_message(choice, parser, c.text, c.finish_reason)
        return Answer(content, calls, finish, c.stop_reason, self.usage())
