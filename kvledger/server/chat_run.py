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
from kvledger.reasoning.parsers import REASONING_PARSERS, ReasoningParser, ReasoningSplitter
from kvledger.sampling_params import RequestOutputKind, SamplingParams
from kvledger.server.errors import APIError, validation_message
from kvledger.server.fields import FieldError
from kvledger.server.protocol import ChatCompletionRequest, UsageInfo
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import until_disconnect, usage_of
from kvledger.server.structured_fields import server_options
from kvledger.server.tool_stream import ToolCallStream, tool_message
from kvledger.server.tools import ToolCall, ToolChoice, chat_constraint
from kvledger.structured.params import StructuredOutputsParams

MAX_MESSAGES = 4096  # a chat request's messages (the body limit bounds them too)
ANY_TEXT = r"[\s\S]*"  # the grammar of a thinking budget without a schema: any answer


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
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    starts_in_reasoning: bool = False
    include_reasoning: bool = True

    def splitter(self) -> ReasoningSplitter | None:
        """A choice's stream splitter (None without a reasoning parser)."""
        return self.reasoning.splitter(self.starts_in_reasoning) if self.reasoning is not None else None

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole choice's (reasoning, answer text); the answer goes on to the tool parsers."""
        if self.reasoning is None:
            return None, text
        thought, answer = self.reasoning.split(text, self.starts_in_reasoning)
        return thought, answer or ""

    def thinking(self, thought: str | None) -> dict[str, str]:
        """The message fields that carry the thinking: vLLM's ``reasoning`` and the former
        ``reasoning_content``; none when empty or not asked for."""
        if not thought or not self.include_reasoning:
            return {}
        return {"reasoning": thought, "reasoning_content": thought}


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
    prepared = PreparedChat(params, tool_choice, prompt, add_special, include_reasoning=body.include_reasoning)
    budget = body.thinking_token_budget
    if cfg.reasoning_parser is None:
        if budget is not None:
            raise APIError(400, "thinking_token_budget needs a reasoning model: start the server with "
                           "--reasoning-parser", param="thinking_token_budget")  # fmt: skip
        return prepared
    parser = prepared.reasoning = REASONING_PARSERS[cfg.reasoning_parser]
    prepared.starts_in_reasoning = parser.starts_in_reasoning(prompt, body.chat_template_kwargs)
    if not prepared.starts_in_reasoning:
        return prepared  # no thinking: a grammar holds from the first token, a budget is moot
    if budget is not None and params.structured_outputs is None:
        # The budget is enforced by the grammar machinery: an any-text grammar after the thinking.
        params.structured_outputs = StructuredOutputsParams(regex=ANY_TEXT, **server_options(cfg.structured_outputs_config))
    if params.structured_outputs is not None:
        # The grammar (a schema, or a forced tool call) applies to the answer, after the
        # thinking's end tag (a single special token in the models these parsers serve).
        end_ids = ctx.tokenizer(parser.end, add_special_tokens=False).input_ids
        params.structured_outputs.reasoning_end_ids = tuple(end_ids)
        params.structured_outputs.thinking_budget = budget
    return prepared


@dataclass
class Piece:
    """What one engine step added to the answer."""

    content: str  # text known to be content
    tool_calls: list[dict[str, Any]]  # OpenAI's delta.tool_calls fragments
    finish_reason: str | None  # set on the last piece (OpenAI's: stop, length, tool_calls)
    stop_reason: int | str | None = None  # the stop string or token that ended it
    reasoning: str = ""  # thinking (--reasoning-parser)


@dataclass
class Answer:
    """A finished choice: what /v1/chat/completions would put in its message."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    stop_reason: int | str | None
    usage: UsageInfo
    reasoning: str | None = None  # thinking (--reasoning-parser)


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
            [prepared.prompt], prepared.params, rid, priority, prepared.add_special_tokens,
            cache_salt=body.cache_salt,
        )  # fmt: skip
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
        splitter = self.prepared.splitter()
        async for out in self.stream:
            self.last = out
            c = out.outputs[0]
            finished = c.finish_reason is not None
            thought, text = splitter.step(c.text, final=finished) if splitter is not None else ("", c.text)
            if not self.prepared.include_reasoning:
                thought = ""
            if tools is not None:
                content, fragments, finish = tools.step(text, c.finish_reason if finished else None)
            else:
                content, fragments, finish = text, [], c.finish_reason
            if content or fragments or thought or finished:
                yield Piece(content, fragments, finish, c.stop_reason if finished else None, thought)

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
        thought, text = self.prepared.split(c.text)
        content, calls, finish = tool_message(choice, parser, text, c.finish_reason)
        if thought is not None and content == "":
            content = None
        thought = thought if self.prepared.include_reasoning else None
        return Answer(content, calls, finish, c.stop_reason, self.usage(), thought)
