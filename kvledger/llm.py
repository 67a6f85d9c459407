"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvledger.chat_utils import apply_chat_template
from kvledger.core.engine import LLMEngine
from kvledger.engine.arg_utils import build_engine_config  # also kvledger.llm's, as before
from kvledger.engine.builder import build_engine
from kvledger.engine.gc_heap import deferred_full_collections
from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.inputs import PromptType
from kvledger.ledger.snapshot import LedgerSnapshot
from kvledger.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvledger.pooling.config import PoolerConfig
from kvledger.pooling.params import PoolingParams
from kvledger.pooling.score import cosine, encode_pair, pair_up, truncate, truncation_length
from kvledger.sampling_params import SamplingParams

__all__ = ["LLM", "build_engine_config"]


class LLM:
    """Offline inference, as vLLM's ``LLM``: ``LLM(model=...).generate(prompts, params)``."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        so_config = dict(kwargs.pop("structured_outputs_config", None) or {})
        backend = so_config.pop("backend", "auto")
        if so_config:
            raise ConfigError(f"structured_outputs_config: only 'backend' is read offline; got {sorted(so_config)}")
        from kvledger.structured.backends import BACKENDS

        if backend not in BACKENDS:
            raise ConfigError(f"structured_outputs_config backend {backend!r} is not one of {', '.join(BACKENDS)}")
        kwargs["structured_outputs_backend"] = backend  # vLLM's StructuredOutputsConfig.backend
        self.llm_engine = build_engine(build_engine_config(model, **kwargs))

    @property
    def engine(self) -> LLMEngine:
        return self.llm_engine

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        """The model folder's tokenizer (a transformers tokenizer), as in vLLM."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's rule:
        they apply when no sampling_params are passed; generation_config="vllm" drops them)."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def reset_prefix_cache(self, *, reset_connector: bool = False) -> bool:
        """Drop every cached prefix block, on the device and in the host tier (and with
        ``reset_connector`` the disk tier's files); False (with a warning) while requests hold
        blocks."""
        return self.llm_engine.reset_prefix_cache(reset_connector=reset_connector)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A prompt is text, a list of token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts (``kvledger.inputs.TextPrompt`` / ``TokensPrompt``).
        """
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        return self._run([_parse_prompt(p) for p in prompts], sampling_params, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's ``LLM.embed``; needs runner="pooling").

        Each prompt is one prefill through the same scheduler, KV pool and prefix cache as
        generation; the vector is pooled as the model's pooler config says (pooling/config.py).
        """
        outs = self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt (vLLM's ``LLM.classify``): a ``*ForSequenceClassification``
        model's ``score`` head on the last token, through its activation (pooling/classifier.py)."""
        outs = self._pool(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per (data_1, data_2) pair (vLLM's ``LLM.score``): data_1 is one text or as
        many as data_2. A cross-encoder (a one-label classifier) reads each pair as one prompt;
        an embedding model scores the cosine of the two texts' embeddings."""
        pooler = self._pooler()
        pairs = pair_up(data_1, data_2, ("data_1", "data_2"))
        eng = self.llm_engine
        k = truncation_length(truncate_prompt_tokens, eng.max_model_len)
        if pooler.classifier is None:  # bi-encoder: embed each distinct text once
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            params = replace(pooling_params or PoolingParams(), task="embed")
            vecs = dict(zip(texts, self._pool(texts, params, "embed", use_tqdm, truncate_prompt_tokens)))
            return [
                ScoringRequestOutput(
                    f"{vecs[a].request_id}_{vecs[b].request_id}",
                    ScoringOutput(cosine(vecs[a].outputs.data, vecs[b].outputs.data)),
                    vecs[a].prompt_token_ids + vecs[b].prompt_token_ids, True,
                )
                for a, b in pairs
            ]  # fmt: skip
        tok = self.get_tokenizer()
        ids = [{"prompt_token_ids": encode_pair(tok, a, b, max_length=k)} for a, b in pairs]
        params = replace(pooling_params or PoolingParams(), task="score")
        outs = self._pool(ids, params, "score", use_tqdm, None)
        return [
            ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0]), o.prompt_token_ids, o.finished)
            for o in outs
        ]

    def _pooler(self) -> PoolerConfig:
        pooler = self.llm_engine.pooler_config
        if pooler is None:
            raise InvalidRequestError(
                "embed, classify and score need the pooling runner: LLM(model, runner='pooling'); "
                "this LLM runs the generate runner"
            )
        return pooler

    def _pool(self, prompts, pooling_params, task: str, use_tqdm: bool, truncate_prompt_tokens: int | None):
        """Pooling requests of ``task`` to completion, in order (PoolingRequestOutputs)."""
        pooler = self._pooler()
        if task not in pooler.tasks:
            raise InvalidRequestError(
                f"this model does not support {task}: it supports {', '.join(pooler.tasks)}"
            )
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        parsed = [_parse_prompt(p) for p in prompts]  # type: ignore[union-attr]
        k = truncation_length(truncate_prompt_tokens, self.llm_engine.max_model_len)
        if k is not None:
            eng = self.llm_engine
            parsed = [(t, truncate(eng.tokenize(t) if ids is None else ids, k), s) for t, ids, s in parsed]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(parsed)
        if len(pooling_params) != len(parsed):
            raise ConfigError(f"got {len(pooling_params)} pooling params for {len(parsed)} prompts")
        pooling_params = [replace(p, task=task) for p in pooling_params]
        with deferred_full_collections():
            return self._submit_and_step(parsed, pooling_params, use_tqdm)  # type: ignore[arg-type]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation is rendered with the tokenizer's chat template (or ``chat_template``)
        and then generated like a text prompt.
        """
        tok = self.get_tokenizer()
        if tok is None:
            raise InvalidRequestError("this model folder has no tokenizer, so chat is not available")
        template = chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; pass chat_template=... "
                "(a Jinja template string) or use generate()"
            )
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a conversation (a list of dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        parsed = []
        for conv in conversations:
            prompt = self._render_chat(
                conv, template, add_generation_prompt, continue_final_message, tools,
                chat_template_kwargs or {},
            )  # fmt: skip
            bos = getattr(tok, "bos_token", None)
            add_special = not (bos and prompt.startswith(bos))  # the template wrote BOS itself
            ids = tok(prompt, add_special_tokens=add_special).input_ids
            parsed.append((prompt, ids, None))
        return self._run(parsed, sampling_params, use_tqdm)

    def _render_chat(self, conv, template, add_generation_prompt, continue_final_message, tools, kwargs) -> str:
        import jinja2

        if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m for m in conv):
            raise InvalidRequestError("each message must be a dict with a 'role' (and 'content')")
        try:
            return apply_chat_template(
                self.get_tokenizer(), conv, template, add_generation_prompt,
                continue_final_message, tools=tools, **kwargs,
            )  # fmt: skip
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from None

    def _run(
        self,
        prompts: list[tuple[str | None, list[int] | None, str | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """(text, token ids, cache salt) prompts to completion, in order (final outputs only)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ConfigError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        with deferred_full_collections():  # full GC walks wait for the return (engine/gc_heap.py)
            return self._submit_and_step(prompts, sampling_params, use_tqdm)

    def _submit_and_step(
        self,
        prompts: list[tuple[str | None, list[int] | None, str | None]],
        sampling_params: Sequence[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        eng = self.llm_engine
        # Validate everything first so that one bad prompt leaves nothing half-submitted.
        ids = []
        for (text, toks, _), sp in zip(prompts, sampling_params):
            toks = eng.tokenize(text) if toks is None else list(toks)
            eng.validate_prompt(toks)
            eng.check_params(sp)
            ids.append(toks)
        rids = []
        for (text, _, salt), toks, sp in zip(prompts, ids, sampling_params):
            rid = eng.add_request(toks, sp, cache_salt=salt)
            eng.groups[rid].prompt = text
            rids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(rids):
                for out in eng.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in rids:
                if rid not in results:
                    eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in rids]

    def ledger(self) -> LedgerSnapshot:
        return self.engine.ledger()


def _parse_prompt(p) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache salt) of one prompt in any of the accepted shapes."""
    if isinstance(p, str):
        return p, None, None
    if isinstance(p, dict):
        unknown = set(p) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown:
            raise InvalidRequestError(
                f"unsupported prompt key(s) {sorted(unknown)}; a prompt dict has 'prompt' "
                "(TextPrompt) or 'prompt_token_ids' (TokensPrompt)"
            )
        salt = p.get("cache_salt")
        if "prompt_token_ids" in p:
            return p.get("prompt"), list(p["prompt_token_ids"]), salt
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise InvalidRequestError("TextPrompt['prompt'] must be a string")
            return p["prompt"], None, salt
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(p, Sequence):
        return None, list(p), None
    raise InvalidRequestError(
        f"a prompt is a string, a list of token ids or a TextPrompt/TokensPrompt dict; got {type(p).__name__}"
    )
