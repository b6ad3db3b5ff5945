"""The vLLM engine of a prefill or decode instance: construction and generation.

Both instance roles run the same engine; they differ only in what they ask of it.
Generation works on token ids end to end: the gateway tokenizes and detokenizes, so
that tokens can be split between two engines without a text round trip.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from shared import tracing
from shared.config import ClusterConfig
from shared.engine.spin import SPIN_ENV
from shared.engine.stages import STAGES_ENV
from shared.instance import EngineLoad
from shared.messages import FinishReason, Sampling, TokenLogprobs


@dataclass(frozen=True)
class Step:
    """What one engine step produced for a request."""

    token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None  # the connector's word on a finished request
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asks for them
    index: int = 0  # which of the request's n outputs (vLLM's parallel sampling)
    prompt_logprobs: list[TokenLogprobs] | None = None  # from the prompt's second token on (first step only)




def engine_environment(config: ClusterConfig) -> dict[str, str]:
    """Environment vLLM-CPU reads at import; harmless on GPU builds."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        # Several engines share a small machine. vLLM's "auto" binding pins every
        # engine to the same core; unbound, each needs OMP_NUM_THREADS set too, or it
        # keeps one OpenMP thread per core and engines thrash each other (measured:
        # 32 tokens in 5.7-9.1 s instead of 0.3 s beside a busy neighbour).
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "OMP_NUM_THREADS": str(config.engine_threads),
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Read by limit_idle_spin in every vLLM process (our vLLM plugin runs it there).
        SPIN_ENV: str(config.engine_spin_s),
        **(tracing.ENGINE_ENVIRONMENT if config.otlp_endpoint else {}),
    }


def kv_transfer_config(config: ClusterConfig, node: str):  # -> vllm KVTransferConfig
    """The Yuebing connector (shared/kv/connector.py), talking to `node`'s messenger."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="YuebingConnector",
        kv_connector_module_path="shared.kv.connector",
        kv_role="kv_both",
        # A block that fails to load is computed instead of failing the request.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "kv_dir": config.kv_root,
            "node": node,
            "block_size": config.block_size,
            "salt": config.model_salt.decode(),  # the gateway's and the Conductor's block-hash salt
            "model": config.model_identity,  # pool and SSD headers: name and weights
        },
    )


def build_engine(config: ClusterConfig, node: str | None = None, stages: int = 1, role: str = "decode"
                 ) -> tuple[Any, EngineLoad]:  # (vllm AsyncLLM, its live load)
    """An engine of `role`; with `node`, wired to that node's pool through the KV connector.
    On a GPU it runs on the devices its launcher made visible (CUDA_VISIBLE_DEVICES),
    sharded over the role's tensor-parallel size, with CUDA graphs unless they are off.
    With `stages` > 1, a CPP group: vLLM's pipeline parallelism over that many worker
    processes, each owning a share of the layers. vLLM advances a prompt's computed
    tokens when it schedules a chunk, so with chunked prefill the next chunk of the
    same prompt enters stage 0 while the last one is on stage 1 (docs/long-context.md, "Long
    context")."""
    for key, value in engine_environment(config).items():
        os.environ.setdefault(key, value)
    os.environ[STAGES_ENV] = str(stages)  # read by the stage-buffer plugin in the engine's processes
    # Imported here: vLLM takes seconds to import, and only engine services need it.
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    load = EngineLoad()

    class LoadRecorder(StatLoggerBase):
        """Keeps the scheduler's queue and KV usage where heartbeats read them."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                load.num_waiting = scheduler_stats.num_waiting_reqs
                load.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    args = engine_args(config, node, stages, role, on_gpu=current_platform.is_cuda_alike())
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[LoadRecorder])
    # vLLM reads some of its settings from the environment on every output (its
    # statistics: two getenv calls a token); its engine processes cache them once up,
    # as this one does now (vLLM's own API server does not). Nothing sets them later.
    from vllm import envs

    envs.enable_envs_cache()
    return engine, load


def engine_args(config: ClusterConfig, node: str | None, stages: int, role: str, on_gpu: bool):  # -> AsyncEngineArgs
    """vLLM's settings for an engine of `role` (see `build_engine`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=config.model,
        served_model_name=config.served_model_name,
        max_model_len=config.max_model_len,
        dtype=config.dtype,
        # A CPU engine has no graphs to capture; on a GPU, vLLM's default (graphs) unless turned off.
        enforce_eager=not (on_gpu and config.cuda_graphs),
        tensor_parallel_size=config.tensor_parallel_size(role),
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=config.engine_prefix_caching,
        disable_log_stats=True,
        seed=0,
        scheduling_policy="priority",  # a request's `priority`, then arrival (all at 0: first come, first served)
        block_size=config.block_size,
        max_num_batched_tokens=config.step_tokens,
        long_prefill_token_threshold=config.prompt_chunk_tokens(role),
        pipeline_parallel_size=stages,
        # Pipeline stages and tensor shards are processes; vLLM's CPU platform insists on them anyway.
        distributed_executor_backend="mp" if stages * config.tensor_parallel_size(role) > 1 else None,
        kv_transfer_config=kv_transfer_config(config, node) if node else None,
        # vLLM's span of each request, a child of ours when generate passes the trace on.
        otlp_traces_endpoint=tracing.traces_url(config.otlp_endpoint) if config.otlp_endpoint else None,
    )


def sampling_params(
    sampling: Sampling, max_tokens: int, kv_transfer_params: dict[str, Any] | None = None, produced: int = 0,
    n: int = 1, prompt_logprobs: bool = False,
):  # -> vllm.SamplingParams
    """vLLM's parameters for one engine's share of a request: `max_tokens` more
    tokens, after the `produced` output tokens its prompt already ends with (decode
    continuing from prefill's first token: 1). Only min_tokens depends on the share:
    every other field holds for any stretch of the output (what does not, a
    history-dependent request avoids by running decode from the prompt alone; see
    `Sampling.history_dependent`). `n`: outputs sampled (decode's; prefill makes one).
    `prompt_logprobs`: this engine prefills the prompt, so it computes those asked for
    (vLLM then reads no cached KV for it: each prompt token must be computed)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if sampling.structural_tag:
        structured = StructuredOutputsParams(structural_tag=sampling.structural_tag)
    elif sampling.json_schema:
        structured = StructuredOutputsParams(json=sampling.json_schema)
    elif sampling.json_object:
        structured = StructuredOutputsParams(json_object=True)
    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        min_tokens=min(max_tokens, max(0, sampling.min_tokens - produced)),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=list(sampling.stop_token_ids),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias) or None,
        bad_words=list(sampling.bad_words) or None,
        allowed_token_ids=list(sampling.allowed_token_ids) if sampling.allowed_token_ids is not None else None,
        structured_outputs=structured,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs if prompt_logprobs else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def generate(
    engine,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: Sampling,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    produced: int = 0,
    n: int = 1,
    prompt_logprobs: bool = False,
    cache_salt: str = "",
) -> AsyncIterator[Step]:
    """Run one request; cancelling the consumer aborts it inside the engine.
    `kv_transfer_params` is what the Yuebing connector reads (see shared/kv/connector.py);
    `produced`, `n` and `prompt_logprobs`: see `sampling_params`. With n > 1, a step an output.
    `cache_salt` splits vLLM's own prefix cache as the cluster's block hashes are split
    (its tenant's cache group: shared/tenants.py).
    vLLM's own span of the request is a child of the caller's span now (not of whatever
    span the first step is awaited in)."""
    params = sampling_params(sampling, max_tokens, kv_transfer_params, produced, n, prompt_logprobs)
    return _steps(engine.generate(_prompt(prompt_token_ids, cache_salt), params, request_id,
                                  priority=sampling.priority, trace_headers=tracing.headers()), params)


def _prompt(prompt_token_ids: list[int], cache_salt: str) -> dict[str, Any]:
    return {"prompt_token_ids": prompt_token_ids, **({"cache_salt": cache_salt} if cache_salt else {})}


async def _steps(outputs: AsyncIterator[Any], params: Any) -> AsyncIterator[Step]:
    async for out in outputs:
        for step in steps_of(out, params):
            yield step


def steps_of(out: Any, params: Any) -> list[Step]:
    """One vLLM RequestOutput as a step of each of its outputs."""
    # Only the first output carries them: the prompt's, for every choice.
    prompt_rows = [token_logprobs(d, params.prompt_logprobs) for d in out.prompt_logprobs or () if d is not None]
    return [Step(
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason if completion.finished() else None,
        num_cached_tokens=out.num_cached_tokens or 0,
        kv_transfer_params=out.kv_transfer_params if out.finished else None,
        logprobs=None if completion.logprobs is None else [token_logprobs(d, params.logprobs)
                                                           for d in completion.logprobs],
        index=completion.index,
        prompt_logprobs=prompt_rows or None,
    ) for completion in out.outputs]


class Run:
    """One request whose steps go to `on_step` as the engine's output task produces
    them, in that task: no task of the request's own wakes for each step, as one
    iterating AsyncLLM.generate does (its queue, its event and the generators
    around it cost a stream more CPU a token than what it does with the token)."""

    def __init__(self, params: Any, on_step: Callable[[Step], None]) -> None:
        self.params, self.on_step = params, on_step
        loop = asyncio.get_running_loop()
        self.started = loop.create_future()  # its first step is out, or it ended
        self.ended = loop.create_future()  # every output ended, or it failed
        self.error: BaseException | None = None
        self.complete = False  # the engine finished it (else it may still run there)
        self.request_id = ""  # the engine's own id for it

    def take_over(self, collector: Any) -> None:
        """Receive what vLLM's output processor puts into the request's own collector
        (AsyncLLM.add_request's: a RequestOutput a step, or the error that ends it)."""
        self.request_id = collector.request_id
        collector.put = self.put
        try:
            early = collector.get_nowait()  # put before the hand-off
        except Exception as e:  # noqa: BLE001 (an error it held: the request's end)
            early = e
        if early is not None:
            self.put(early)

    def put(self, out: Any) -> None:
        if isinstance(out, BaseException):
            self.end(out)
            return
        try:
            steps = steps_of(out, self.params)
        except Exception as e:  # noqa: BLE001 (never into vLLM's output task: it would fail every request)
            self.end(e)
            return
        for step in steps:
            self.take(step)
        if out.finished:
            self.finish()

    def take(self, step: Step) -> None:
        """One output's step, to `on_step`."""
        if self.ended.done():  # ended, or given up (an abort's last output)
            return
        try:
            self.on_step(step)
        except Exception as e:  # noqa: BLE001 (as in put)
            self.end(e)
            return
        if not self.started.done():
            self.started.set_result(None)

    def finish(self) -> None:
        """The engine finished every output."""
        if not self.ended.done():
            self.complete = True
            self.end()

    def end(self, error: BaseException | None = None) -> None:
        self.error = error
        for future in (self.started, self.ended):
            if not future.done():
                future.set_result(None)

    async def wait(self) -> None:
        """Until every output ended; raises what ended it otherwise."""
        await self.ended
        if self.error is not None:
            raise self.error


@asynccontextmanager
async def running(
    engine,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: Sampling,
    max_tokens: int,
    on_step: Callable[[Step], None],
    kv_transfer_params: dict[str, Any] | None = None,
    produced: int = 0,
    n: int = 1,
    prompt_logprobs: bool = False,
    cache_salt: str = "",
    lean: Any = None,
) -> AsyncIterator[Run]:
    """`generate`'s request, its steps handed to `on_step` (see Run); leaving the
    block before it ended (cancelled, timed out, failed) aborts it in the engine.
    `lean`: the engine's LeanOutputs (shared/engine/outputs.py), which read the steps
    of a request it can serve from the engine core's outputs themselves."""
    params = sampling_params(sampling, max_tokens, kv_transfer_params, produced, n, prompt_logprobs)
    run = Run(params, on_step)
    collector = await engine.add_request(request_id, _prompt(prompt_token_ids, cache_salt), params,
                                         priority=sampling.priority, trace_headers=tracing.headers())
    run.take_over(collector)
    if lean is not None:
        lean.add(run)
    try:
        yield run
    finally:
        if lean is not None:
            lean.drop(run)
        if not run.complete:  # cancelled, timed out, or failed on our side
            run.end()  # the abort's own last output is nobody's step
            await engine.abort(run.request_id, internal=True)


def token_logprobs(position: dict[int, Any], k: int) -> TokenLogprobs:
    """vLLM's logprobs of one output position (token id → Logprob: the sampled token
    first, then the top `k`, a repeat of the sampled one merged) back into the
    sampler's row: sampled, then the top `k` in rank order."""
    sampled_id, sampled = next(iter(position.items()))
    top = sorted((lp.rank, token_id, lp.logprob) for token_id, lp in position.items() if lp.rank <= k)
    return TokenLogprobs(token_ids=[sampled_id, *(t for _, t, _ in top)],
                         logprobs=[sampled.logprob, *(lp for _, _, lp in top)], rank=sampled.rank)
