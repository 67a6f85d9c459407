"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence

from kvledger.config import CacheConfig, EngineConfig, SchedulerConfig
from kvledger.core.engine import LLMEngine
from kvledger.errors import ConfigError
from kvledger.ledger.snapshot import LedgerSnapshot
from kvledger.outputs import RequestOutput
from kvledger.sampling_params import SamplingParams

_SCHED = {f for f in SchedulerConfig.__dataclass_fields__}
_CACHE = {f for f in CacheConfig.__dataclass_fields__}
_ENGINE = {f for f in EngineConfig.__dataclass_fields__} - {"scheduler", "cache", "model"}


def build_engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """Split flat keyword options (vLLM style) into the three config dataclasses."""
    if model is None:
        from kvledger.model.tiny import default_model_path

        model = str(default_model_path())
    if "max_num_batched_tokens" not in kwargs and "max_model_len" in kwargs:
        kwargs["max_num_batched_tokens"] = max(2048, kwargs["max_model_len"])
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED}
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE}
    eng = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE}
    if kwargs:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(kwargs))}")
    return EngineConfig(
        model=str(model), scheduler=SchedulerConfig(**sched), cache=CacheConfig(**cache), **eng
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(build_engine_config(model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ConfigError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        eng = self.engine
        # Validate everything first so that one bad prompt leaves nothing half-submitted.
        ids = []
        for p, sp in zip(prompts, sampling_params):
            toks = eng.tokenize(p) if isinstance(p, str) else list(p)
            eng.validate_prompt(toks)
            eng.check_logprobs(sp)
            ids.append(toks)
        rids = []
        for p, toks, sp in zip(prompts, ids, sampling_params):
            rid = eng.add_request(toks, sp)
            if isinstance(p, str):
                eng.groups[rid].prompt = p
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
