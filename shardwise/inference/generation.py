"""Hugging Face ``generate`` settings, resolved for the fast path.

``resolve(model, input_ids, kwargs)`` merges the call's keyword arguments over the model's
``generation_config`` and Hugging Face's defaults, and returns a ``Plan``: the number of new
tokens, EOS / pad ids, the token picker (greedy or sampling with temperature / top-k / top-p /
min-p, using transformers' own logits warpers), and ``fallback``: the name of the first
setting the fast path does not implement (beam search, repetition penalty, ...), in which
case the engine hands the call to the module's own ``generate``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

#: settings the fast loop implements; anything else set away from its default falls back.
_HANDLED = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample",
            "temperature", "top_k", "top_p", "min_p", "eos_token_id", "pad_token_id",
            "bos_token_id", "use_cache", "num_return_sequences", "return_dict_in_generate",
            "output_scores", "cache_implementation", "decoder_start_token_id", "compile_config",
            "disable_compile", "transformers_version", "_from_model_config"}
#: call arguments the fast loop implements besides GenerationConfig fields.
_CALL_ARGS = {"input_ids", "attention_mask", "stopping_criteria", "streamer", "generation_config",
              "inputs"}


@dataclass
class Plan:
    """What one fast-path ``generate`` call does."""

    max_new: int
    pick: Any
    """(sequences, float logits) -> next tokens."""
    eos: Optional[torch.Tensor]
    pad: int
    stopping: Any
    streamer: Any
    fallback: Optional[str] = None
    """The first setting the fast path does not implement (None: the fast path runs)."""


def _defaults() -> Dict[str, Any]:
    from transformers import GenerationConfig
    return GenerationConfig._get_default_generation_params()


def _merged(model: Any, kwargs: Dict[str, Any]) -> tuple:
    from transformers import GenerationConfig
    base = kwargs.get("generation_config") or getattr(model, "generation_config", None) \
        or GenerationConfig()
    gen = copy.deepcopy(base)
    extra = gen.update(**{k: v for k, v in kwargs.items() if k not in _CALL_ARGS})
    for key, value in _defaults().items():
        if getattr(gen, key, None) is None:
            setattr(gen, key, value)
    return gen, extra


def _unsupported(gen: Any, extra: Dict[str, Any], kwargs: Dict[str, Any]) -> Optional[str]:
    if extra:
        return f"argument {sorted(extra)[0]!r}"
    if gen.num_beams != 1:
        return f"num_beams={gen.num_beams} (beam search)"
    if gen.num_return_sequences != 1:
        return f"num_return_sequences={gen.num_return_sequences}"
    if gen.return_dict_in_generate or gen.output_scores:
        return "return_dict_in_generate/output_scores"
    defaults = _defaults()
    for key, value in gen.to_diff_dict().items():
        if key in _HANDLED or key.startswith("_"):
            continue
        if value in (None, False, {}) and defaults.get(key) is None:
            continue
        if value != defaults.get(key, None):
            return f"{key}={value!r}"
    return None


def _eos(gen: Any, device: torch.device) -> Optional[torch.Tensor]:
    eos = gen.eos_token_id
    if eos is None:
        return None
    eos = [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(eos, device=device)


def _picker(gen: Any, prompt_len: int, eos: Optional[torch.Tensor]):
    from transformers.generation import logits_process as lp
    procs: List[Any] = []
    min_new = gen.min_new_tokens or 0
    min_new = max(min_new, (gen.min_length or 0) - prompt_len)
    if min_new > 0 and eos is not None:
        procs.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos))
    if gen.do_sample:
        if gen.temperature is not None and gen.temperature != 1.0:
            procs.append(lp.TemperatureLogitsWarper(gen.temperature))
        if gen.top_k is not None and gen.top_k != 0:
            procs.append(lp.TopKLogitsWarper(top_k=gen.top_k, min_tokens_to_keep=1))
        if gen.top_p is not None and gen.top_p < 1.0:
            procs.append(lp.TopPLogitsWarper(top_p=gen.top_p, min_tokens_to_keep=1))
        if getattr(gen, "min_p", None) is not None:
            procs.append(lp.MinPLogitsWarper(min_p=gen.min_p, min_tokens_to_keep=1))

    def pick(seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for proc in procs:
            scores = proc(seq, scores)
        if gen.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return scores.argmax(dim=-1)
    return pick


def resolve(model: Any, input_ids: torch.Tensor, kwargs: Dict[str, Any]) -> Plan:
    """The fast-path plan for ``generate(input_ids, **kwargs)`` (see the module docstring)."""
    gen, extra = _merged(model, kwargs)
    t = input_ids.shape[-1]
    max_new = gen.max_new_tokens if gen.max_new_tokens is not None else gen.max_length - t
    eos = _eos(gen, input_ids.device)
    pad = gen.pad_token_id
    if pad is None:
        pad = int(eos[0]) if eos is not None else 0
    plan = Plan(max(int(max_new), 0), _picker(gen, t, eos), eos, int(pad),
                kwargs.get("stopping_criteria"), kwargs.get("streamer"))
    plan.fallback = _unsupported(gen, extra, kwargs)
    return plan
