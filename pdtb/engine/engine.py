"""LLMEngine: model + page pool + scheduler + runner + sampler, stepped one batch at a time.

Used directly by the offline CLI and the benchmark; the node processes drive the same
`step()` from their asyncio loops.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time

import torch

from pdtb.engine import hf_compat, paged_attention
from pdtb.engine.config import EngineConfig
from pdtb.engine.loader import ModelInfo, load_model
from pdtb.engine.page_pool import PagePool
from pdtb.engine.runner import BatchChunk, ModelRunner
from pdtb.engine.sampler import sample
from pdtb.engine.scheduler import Scheduler, SchedulerOutput, StepEvent, append_token
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from pdtb.engine.step_cost import StepCostFit
from pdtb.engine.step_shape import StepShape


def prefix_namespace(model, dtype: str) -> str:
    """Namespace of this engine's page hashes: the model's configuration (its path left out,
    so the same checkpoint at another path on another host still matches) and the KV dtype."""
    cfg = model.config.to_dict()
    cfg.pop("_name_or_path", None)
    digest = hashlib.blake2b(json.dumps(cfg, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    return f"{cfg.get('model_type', 'model')}-{digest}-{dtype}"


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, info: ModelInfo | None = None,
                 policy=None) -> None:
        paged_attention.register()
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if model is None:
            model, tokenizer, info = load_model(config.model_dir, config.device, config.dtype,
                                                attn_implementation=paged_attention.ATTN_NAME)
        else:
            model.set_attn_implementation(paged_attention.ATTN_NAME)
        self.model, self.tokenizer, self.info = model, tokenizer, info
        self.spec = info.kv_spec(config.page_size, config.dtype)
        on_cpu = torch.device(config.device).type == "cpu"
        self.pool = PagePool(self.spec, config.num_pages, device=config.device, charge=config.charge,
                             shared=config.shared_kv)
        self.host_pool = PagePool(self.spec, config.host_kv_pages, device="cpu", tier="host",
                                  pin_memory=config.device.startswith("cuda"),
                                  shared=config.shared_kv and on_cpu) if config.host_kv_pages else None
        self.scheduler = Scheduler(config.scheduler_config(info.max_model_len), self.pool, policy=policy,
                                   host_pool=self.host_pool)
        self.step_cost = self.scheduler.step_cost = StepCostFit()  # what this node's steps cost (policies read it)
        if config.prefix_cache:
            self.scheduler.prefix_ns = prefix_namespace(model, config.dtype)
        kernel = self._decode_kernel(config)
        triton_gpu = self.pool.kv.is_cuda and getattr(kernel, "name", "") == "triton"
        self.fused_norms = 0  # RMSNorm modules swapped for the fused kernel (fused_norm.py)
        if config.fused_norm and triton_gpu:
            from pdtb.engine.fused_norm import fuse_norms

            self.fused_norms = fuse_norms(model)
        hf_compat.check_model(model, self.pool.kv, config.page_size, kernel)
        self.runner = ModelRunner(model, self.pool.kv, config.page_size, config.device, kernel=kernel)
        if config.lean_forward and on_cpu:
            from pdtb.engine import lean_forward

            if lean_forward.unsupported(model) is None:
                from pdtb.engine import cpu_kernel

                self.runner.lean = lean_forward.LeanForward(model, norm=cpu_kernel.rms_norm())
        if config.cuda_graphs and triton_gpu:
            from pdtb.engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(model, self.pool.kv, config.page_size, kernel,
                                              max_rows=config.max_num_seqs,
                                              max_len=self.scheduler.config.max_model_len)
        self._ids = itertools.count()
        self.last_output: SchedulerOutput | None = None

    def _decode_kernel(self, config: EngineConfig):
        """The paged decode kernel where it applies (see EngineConfig.decode_attention): Triton
        on a GPU, C on a float32 CPU pool."""
        if config.decode_attention != "auto":
            return None
        if self.pool.kv.is_cuda:
            from pdtb.engine import triton_decode

            return triton_decode.load(str(self.pool.kv.device))
        if self.pool.kv.dtype != torch.float32:
            return None
        from pdtb.engine import cpu_kernel

        return cpu_kernel.load()

    # ---- requests -------------------------------------------------------------------------
    def make_sequence(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                      **kw) -> Sequence:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.info.vocab_size})")
        return Sequence.from_prompt(request_id or f"req-{next(self._ids)}", prompt_token_ids, params, **kw)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.last_output = out
        if not out.chunks:
            return []
        shape = StepShape.of(out.chunks)  # (before the sequences advance)
        pages_of = self.pool.pages_of
        batch = [BatchChunk(c.seq.request_id, c.seq.token_ids[c.seq.num_computed_tokens:c.seq.num_computed_tokens + c.num_new_tokens],
                            c.seq.num_computed_tokens, pages_of(c.seq.request_id), c.wants_logits)
                 for c in out.chunks]
        logits = self.runner.run(batch)
        sampling = [c.seq for c in out.chunks if c.wants_logits]
        register = self.scheduler.register_computed
        for c in out.chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            register(c.seq)
        tokens = sample(logits, [s.params for s in sampling], [s.params.first_index + s.num_output_tokens for s in sampling])
        events = [self._append(seq, tok) for seq, tok in zip(sampling, tokens)]
        if not (out.moves or out.preempted):  # (copies and recomputes are not in the shape)
            self.step_cost.observe(shape, time.perf_counter() - t0)
        return events

    def _append(self, seq: Sequence, token: int) -> StepEvent:
        return append_token(self.scheduler, seq, token, self.info.eos_token_ids)

    # ---- start-up ---------------------------------------------------------------------------
    def warm_up(self, prompt_len: int = 48, decode_steps: int = 3) -> float:
        """Run throwaway steps through the model runner before serving: a prefill, a mixed step
        (one row decoding beside another's prefill), then decode steps of both. On a GPU the
        first forward passes pay for kernel loading and library handles; measured on an H100,
        about 0.4 s that would otherwise land on the first requests' TTFT. The pages are
        borrowed from the pool and returned; the scheduler never sees these rows. Returns the
        seconds spent (0.0 when the pool cannot spare the pages)."""
        t0 = time.perf_counter()
        n = max(1, min(prompt_len, self.scheduler.config.max_model_len - decode_steps - 2))
        need = -(-(n + decode_steps + 1) // self.spec.page_size)
        rows = {}
        try:
            for rid in ("__warm_up_a__", "__warm_up_b__"):
                pages = self.pool.allocate(rid, need)
                if pages is None:
                    return 0.0
                rows[rid] = pages
            (a, pa), (b, pb) = rows.items()
            prompt = [3 + i % (self.info.vocab_size - 3) for i in range(n)]
            plist = [SamplingParams(max_tokens=1)]
            self.runner.run([BatchChunk(a, prompt, 0, pa, True)])
            logits = self.runner.run([BatchChunk(a, prompt[:1], n, pa, True), BatchChunk(b, prompt, 0, pb, True)])
            sample(logits, plist * 2, [0, 0])
            for i in range(decode_steps):
                logits = self.runner.run([BatchChunk(a, prompt[:1], n + 1 + i, pa, True),
                                          BatchChunk(b, prompt[:1], n + i, pb, True)])
                sample(logits, plist * 2, [0, 0])
            if self.pool.kv.is_cuda:
                torch.cuda.synchronize(self.pool.kv.device)
        finally:
            for rid in rows:
                self.pool.free(rid)
        if self.runner.graphs is not None:  # every decode bucket's graph, before the first request
            self.runner.graphs.capture_all()
        return time.perf_counter() - t0

    # ---- offline ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run all prompts in one continuous batch until every one finishes; input order kept."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
        for s in seqs:
            self.add(s)
        while self.has_work():
            self.step()
        return seqs
