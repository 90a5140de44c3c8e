"""``dsa.LLM``: text in, text out, on a checkpoint folder or the embedded default model.

    llm = dsa.LLM("path/to/checkpoint")                  # or dsa.LLM(): the embedded default (trained)
    out = llm.generate(["The capital of France is"], dsa.SamplingParams(max_tokens=32, temperature=0))
    out[0].text, out[0].token_ids, out[0].finish_reason  # "stop" or "length"
    llm.chat([{"role": "user", "content": "Hi"}])         # the checkpoint's chat template
"""
import json
import os
from dataclasses import dataclass, field

import torch

from dsa.engine import Engine, SamplingParams
from dsa.engine.cpu_threads import apply_cpu_threads
from dsa.kernels.common import cdiv
from dsa.serve.tokenizer import Tokenizer


@dataclass
class Completion:
    """One prompt's result: the generated text (None without a tokenizer) and token ids, why it
    ended ("stop": EOS, a stop token or a stop string; "length": max_tokens; "abort"), the
    logprobs (a :class:`~dsa.engine.sampling.Logprob` per token, when asked for) and the prompt's ids."""
    text: str | None
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list | None = None
    prompt_token_ids: list = field(default_factory=list)


def default_cache_blocks(model, max_model_len: int | None = None) -> dict:
    """The cache pool when none is given: on CUDA 80% of the memory free after loading; elsewhere
    room for one request of ``max_model_len`` tokens (None: ``max_position_embeddings``)."""
    c = model.config
    if model.device.type == "cuda":
        return {"memory_bytes": int(0.8 * torch.cuda.mem_get_info(model.device)[0])}
    return {"num_blocks": cdiv(max_model_len or c.max_position_embeddings, c.block_size)}


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


def generation_defaults(folder) -> dict:
    """The sampling defaults a checkpoint's ``generation_config.json`` gives (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, when ``do_sample`` is not false), as vLLM reads them: what a request or a
    command that leaves them out samples with."""
    path = os.path.join(os.fspath(folder), "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    if config.get("do_sample") is False:
        return {}
    return {k: config[k] for k in SAMPLING_DEFAULTS if k in config}


class LLM:
    """Generation with a tokenizer on one :class:`~dsa.engine.engine.Engine`.

    ``checkpoint``: a HF folder (weights, ``config.json``, ``tokenizer.json``); None: the embedded
    default model (:data:`dsa.model.presets.DEFAULT_CHECKPOINT`, a small trained model with its
    tokenizer). ``tokenizer``: a
    folder or tokenizer object to use instead. ``dtype``/``device``: default bf16 on CUDA, fp32 on
    CPU. ``engine_options``: :class:`~dsa.engine.engine.Engine` arguments (``num_blocks`` or
    ``memory_bytes``, ``max_batch_tokens``, ``cuda_graphs``, ``max_model_len``: the longest request,
    prompt and output; past the config's ``max_position_embeddings`` a checkpoint refuses it with
    a ValueError naming it, a random-weight model built elsewhere (:meth:`from_model`) takes it). ``warmup``: run
    :meth:`Engine.warmup` before returning (None: on CUDA, where Triton compiles on first use;
    skipped on CPU), its report in ``warmup_report``. Thread-safe like the engine.

    ``generation_defaults``: the checkpoint's sampling defaults (:func:`generation_defaults`), which
    ``dsa generate`` and ``dsa serve`` use for what a request leaves out.

    ``cpu_threads``: torch's CPU thread count, set before the model is built (None: on CPU, one per
    CPU that other processes leave free, unless the user set a count with ``OMP_NUM_THREADS`` or
    ``torch.set_num_threads``; on CUDA, untouched): :mod:`dsa.engine.cpu_threads`. The count and
    why in ``cpu_threads`` and ``cpu_threads_reason`` (None when untouched on CUDA).

    ``tp_size``: shard the model over that many tensor-parallel ranks, one process each, started
    by ``torchrun`` (:mod:`dsa.model.parallel`). Every rank builds the LLM and makes the same calls
    with the same prompts (SPMD: every rank computes the same tokens); ``dsa serve --tp`` serves
    one (rank 0 takes the requests, :mod:`dsa.serve.tp_commands`).
    """

    def __init__(self, checkpoint=None, *, tokenizer=None, dtype: torch.dtype | None = None, device=None,
                 warmup: bool | None = None, tp_size: int = 1, cpu_threads: int | None = None,
                 **engine_options):
        from dsa.model import DSAModel
        from dsa.model.presets import DEFAULT_CHECKPOINT

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._set_threads(device, cpu_threads)
        folder = DEFAULT_CHECKPOINT if checkpoint is None else checkpoint
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = DSAModel.from_pretrained(folder, dtype=dtype, device=device, tp_size=tp_size)
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = Tokenizer.from_pretrained(tokenizer)
        elif tokenizer is None and os.path.exists(os.path.join(os.fspath(folder), "tokenizer.json")):
            tokenizer = Tokenizer.from_pretrained(folder)
        self._attach(model, tokenizer, engine_options, warmup)
        self.checkpoint = checkpoint
        self.generation_defaults = generation_defaults(folder)

    @classmethod
    def from_model(cls, model, tokenizer=None, warmup: bool | None = None, cpu_threads: int | None = None,
                   **engine_options) -> "LLM":
        """An LLM over a model already built (e.g. ``DSAModel.random``) and a tokenizer object."""
        llm = cls.__new__(cls)
        llm._set_threads(model.device, cpu_threads)
        llm._attach(model, tokenizer, engine_options, warmup)
        llm.checkpoint = None
        llm.generation_defaults = {}
        return llm

    def _set_threads(self, device: torch.device, cpu_threads: int | None) -> None:
        self.cpu_threads = self.cpu_threads_reason = None
        if device.type == "cpu" or cpu_threads is not None:
            self.cpu_threads, self.cpu_threads_reason = apply_cpu_threads(cpu_threads)

    def _attach(self, model, tokenizer, engine_options: dict, warmup: bool | None) -> None:
        self.model, self.tokenizer = model, tokenizer
        if "num_blocks" not in engine_options and "memory_bytes" not in engine_options:
            engine_options = {**engine_options, **default_cache_blocks(model, engine_options.get("max_model_len"))}
        self.engine = Engine(model, tokenizer=tokenizer, **engine_options)
        self.warmup_report = None
        if warmup or (warmup is None and model.device.type == "cuda"):
            self.warmup_report = self.engine.warmup()

    def encode(self, prompt) -> list:
        """Token ids of a prompt: a string (through the tokenizer) or a list of token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: this checkpoint has no tokenizer.json; pass token ids "
                                 "(or LLM(..., tokenizer=DIR))")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise TypeError(f"prompts: expected strings or lists of token ids, got {prompt!r:.80}")
        return list(prompt)

    def chat_ids(self, messages, **template_vars) -> list:
        """Token ids of one conversation rendered by the tokenizer's chat template (with the
        assistant's generation prompt)."""
        if self.tokenizer is None:
            raise ValueError("chat: this checkpoint has no tokenizer.json")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_vars)

    def generate(self, prompts, sampling: SamplingParams | list | None = None) -> list:
        """``prompts``: a string, or a list of strings or of token id lists; ``sampling``: one for all,
        one per prompt, or None (``SamplingParams()``). Returns a :class:`Completion` per prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return self._complete([self.encode(p) for p in prompts], sampling)

    def chat(self, messages, sampling: SamplingParams | list | None = None, **template_vars) -> list:
        """``messages``: one conversation (dicts with ``role`` and ``content``) or a list of them.
        Returns a :class:`Completion` per conversation. ``template_vars`` reach the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._complete([self.chat_ids(m, **template_vars) for m in conversations], sampling)

    def stream(self, prompts, sampling: SamplingParams | list | None = None):
        """Like :meth:`generate`, yielding each prompt's :class:`~dsa.engine.output.Delta` s as they come
        (``delta.index``: the prompt; ``delta.text``: its new text)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.encode(p) for p in prompts]
        yield from self.engine.stream(ids, sampling=SamplingParams() if sampling is None else sampling)

    def _complete(self, ids: list, sampling) -> list:
        outs = [Completion(None if self.tokenizer is None else "", prompt_token_ids=p) for p in ids]
        for d in self.engine.stream(ids, sampling=SamplingParams() if sampling is None else sampling):
            c = outs[d.index]
            c.token_ids.extend(d.token_ids)
            if d.text:
                c.text += d.text
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
            c.finish_reason = d.finish_reason
        return outs
