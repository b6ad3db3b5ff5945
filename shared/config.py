"""The one cluster configuration that every service reads.

`yuebing up` writes it to a JSON file and passes `--config PATH` to every child; a
container deployment mounts the same file. Per-process identity (instance id, node,
ports) comes from command-line flags, never from this file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType: what its engines take
REQUEST_TIMEOUT_S = 300.0  # a request's deadline, from the gateway on (the simulator's clients too)
# Instances a scoring policy scores per role beyond the prompt's prefix holders: the least
# loaded few (services/conductor/state.py). The live Conductor's and the simulator's default.
SHORTLIST = 4
SHORTLIST_DESCRIPTION = ("instances the policy scores per role beyond the prefix holders: the least loaded few "
                         "(0: every instance)")


# How fast the planner (services/conductor/planner.py) follows a shift: the live
# Conductor's and the simulator's defaults. On `yuebing sim-planner`'s shifting trace
# a 60 s window, 3 confirmations, 4 moves a minute and no burst room gained 1.09x the
# best static split where these gain 1.22x; the dwell time and the confirmations
# still stop a burst. Tests shorten them to see a move in seconds.
PLANNER_WINDOW_S = 30.0  # the arrivals demand is judged on
PLANNER_INTERVAL_S = 10.0  # between decisions
PLANNER_CONFIRM = 2  # decisions in a row that must want the same move
PLANNER_DWELL_S = 60.0  # an instance keeps a role at least this long
# Of a placement's SLOs: past it, admission's room goes by the tenants' classes and
# shares (services/conductor/fairness.py). Measured live (`yuebing bench tenants`, CPU
# engines, docs/benchmarks/tenants.md): a steady tenant beside one flooding at 4x
# capacity kept 20 % of its goodput alone at 0.7, 73 % at 0.3, 83 % at 0.15 (the
# flood's own goodput rising too). The simulator's exact time models favour 0.7: a
# live time model that misses the tails of steps needs the mark lower.
FAIR_SHARE_MARK = 0.15


# Serving modes whose instances have roles the planner may change: colocated
# instances have none, and conditional's rule is sized to its split.
PLANNER_MODES = ("adaptive", "disaggregated")


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting carries its description (`Annotated[T, Meta(description=...)]`):
    `yuebing up` turns them into its flags and their help (yuebing/flags.py)."""

    nats_url: Annotated[str, Meta(description="NATS server the services talk over")] = "nats://127.0.0.1:4222"
    model: Annotated[str, Meta(description="model folder (Hugging Face format)")] = ""
    model_name: Annotated[str, Meta(description="name the API serves the model under (empty: the folder's name)")] = ""
    model_fingerprint: Annotated[
        str, Meta(description="the weights' fingerprint (shared/model_identity.py; empty: computed from the model at start)")
    ] = ""
    max_model_len: Annotated[int, Meta(description="longest prompt plus output, tokens")] = 4096
    dtype: Annotated[
        str, Meta(description="vLLM's dtype for weights and KV (auto: its own choice, as plain vLLM)")
    ] = "auto"
    block_size: Annotated[
        int, Meta(description="tokens per pool block, the unit of block hashes (a multiple of vLLM's block size)")
    ] = 128
    kv_cache_gib: Annotated[
        int, Meta(description="KV cache each vLLM CPU engine reserves, GiB (GPU engines size it from "
                              "gpu_memory_utilization)")
    ] = 1
    engine_threads: Annotated[int, Meta(description="compute threads of each vLLM CPU engine")] = 1
    # --- GPU engines (CPU engines ignore these) ---
    gpu_memory_utilization: Annotated[
        float, Meta(description="share of each GPU's memory a vLLM engine takes (weights, activations, KV cache)")
    ] = 0.9
    prefill_tensor_parallel_size: Annotated[
        int, Meta(description="GPUs each prefill engine shards the model over (tensor parallelism)")
    ] = 1
    decode_tensor_parallel_size: Annotated[
        int, Meta(description="GPUs each decode engine shards the model over (tensor parallelism)")
    ] = 1
    # vLLM's own default on a GPU; CPU engines always run eagerly (no graphs to capture).
    cuda_graphs: Annotated[bool, Meta(description="CUDA graphs in GPU engines (off: eager, slower decode)")] = True
    # --- end of GPU engines ---
    # A long prompt is prefilled in chunks, and the step that ends one prompt starts the next.
    step_tokens: Annotated[
        int, Meta(description="tokens one engine step computes at most (max_num_batched_tokens)")
    ] = 2048
    # Spilled prompts (adaptive and conditional modes) prefill on decode engines beside
    # their streams: capped chunks keep every such step within the TBT SLO.
    decode_chunk_tokens: Annotated[
        int, Meta(description="on engines while they decode, one prompt's tokens per step at the most while others run "
                              "(vLLM's long_prefill_token_threshold; 0: sized to the TBT SLO from the profile)")
    ] = 0
    # vLLM's own default is 1 s; see shared/engine.py limit_idle_spin.
    engine_spin_s: Annotated[
        float, Meta(description="how long vLLM's processes busy-wait for the next message, s")
    ] = 0.002
    # For measuring the control plane alone (`yuebing bench control-plane`): the
    # services are the real ones, the engine under them answers without a model.
    fake_engine_step_ms: Annotated[
        float, Meta(description="benchmarks only: instances run no model and emit a fixed token stream, one token "
                                "per request every this many ms (0: the real engine)")
    ] = 0.0
    heartbeat_interval_s: Annotated[float, Meta(description="seconds between an instance's heartbeats")] = 0.5
    liveness_timeout_s: Annotated[float, Meta(description="an instance silent this long is treated as gone, s")] = 2.0
    # An engine instance told to stop (SIGTERM: a scale-down, a rolling restart) takes
    # nothing new and lets its requests finish this long; a decode's streams still
    # running then go on elsewhere (the gateway continues them exactly), a prefill's
    # prompts are placed again. Below the pods' grace period (compose/kubernetes/).
    drain_timeout_s: Annotated[
        float, Meta(description="how long a stopping engine instance lets its requests finish before handing "
                                "them to others, s")
    ] = 20.0
    schedule_timeout_s: Annotated[
        float, Meta(description="how long the gateway waits for the Conductor's decision, s")
    ] = 2.0
    request_timeout_s: Annotated[
        float, Meta(description="a request's deadline from the gateway on, s")
    ] = REQUEST_TIMEOUT_S
    # A live decode instance whose stream goes quiet (a lost chunk) must not hold a
    # request to its deadline; long enough for decode to compute a whole prompt first.
    token_idle_timeout_s: Annotated[
        float, Meta(description="longest wait for a request's next token from a live decode instance, s")
    ] = 30.0
    # Off, every token goes through nats-server (for comparison: `yuebing bench control-plane`).
    token_channels: Annotated[
        bool, Meta(description="decode instances stream tokens to each gateway over a direct, sealed TCP connection "
                               "(off: over NATS)")
    ] = True
    # --- retry and migration (services/gateway/retry.py) ---
    # Every attempt counts: the first, each prefill placed again, each decode asked
    # after a refusal, and each continuation of a stream whose decode died.
    max_attempts: Annotated[
        int, Meta(description="most placements one request goes through, its first included (1: no retry)")
    ] = 3
    # A prefill whose instance keeps beating but never answers (a hung engine) is
    # given up on after this (or after 4 x its predicted TTFT, if longer: a long queue
    # is no stall), and the request placed on another prefill instance.
    prefill_timeout_s: Annotated[
        float, Meta(description="longest wait for a prefill's first token before placing it elsewhere, s")
    ] = 60.0
    # --- end of retry and migration ---
    # Where prefill runs (services/conductor/modes.py). Adaptive is the default: it
    # disaggregates, which keeps prefill out of the decode batch so that TBT holds
    # under load, and spills a request disaggregation would refuse onto any engine that
    # can serve it in time, so that two engines never serve less than two plain vLLM
    # servers (docs/scheduling.md, "Serving modes").
    mode: Annotated[
        str, Meta(description="serving mode: adaptive (disaggregated; a request it would refuse runs both phases "
                              "on any instance that can serve it in time), disaggregated, colocated (every instance "
                              "prefills and decodes) or conditional (prefill on the decode instance when a rule allows)")
    ] = "adaptive"
    conditional_rule: Annotated[
        str, Meta(description="conditional mode's rule: mooncake (unchunked and within the TBT SLO), dynamo or llmd")
    ] = "mooncake"
    local_prefill_tokens: Annotated[
        int, Meta(description="dynamo and llmd rules' N: a decode prefills fewer than N uncached tokens itself "
                              "(dynamo), or at most N (llmd)")
    ] = 1000
    # The names are services/conductor/policy.py's.
    policy: Annotated[str, Meta(description="prefill scheduling policy")] = "round_robin"
    # Shedding by default: a request predicted to miss its SLOs is a 429 at once,
    # rather than work done for a client that has given up.
    admission: Annotated[str, Meta(description="early rejection mode")] = "predictive"
    # A request may set its own (x-yuebing-slo-ttft-ms / -tbt-ms headers).
    # 0: derived from the profile (shared/predictor.py default_slos_ms): 10x a lone
    # full-context prefill, 5x a lone decode step at full context.
    slo_ttft_ms: Annotated[float, Meta(description="default TTFT SLO, ms (0: 10x a full-context prefill, profiled)")] = 0.0
    slo_tbt_ms: Annotated[float, Meta(description="default TBT SLO, ms (0: 5x a lone full-context decode step, profiled)")] = 0.0
    profile: Annotated[
        str, Meta(description="time-model profile from `yuebing profile` (empty: the shipped one)")
    ] = ""
    decode_time_s: Annotated[
        float, Meta(description="predictive admission's t_d: how long a request is assumed to decode, s")
    ] = 10.0
    learn_decode_time: Annotated[
        bool, Meta(description="learn t_d from the decodes that complete, starting at decode_time_s")
    ] = True
    # Each instance's predictions times how much slower than its profile it runs
    # now (shared/calibration.py): the profile was measured on an idle machine.
    calibrate_time_model: Annotated[
        bool, Meta(description="correct the time model by each instance's observed over predicted times")
    ] = True
    # Under overload admission holds every queue at the edge of its SLO: predictions
    # there must be an upper quantile of the time to come, not its mean, for the
    # admitted requests to meet their SLOs this often.
    slo_attainment: Annotated[
        float, Meta(description="share of admitted requests that calibrated predictions aim to keep within their SLOs")
    ] = 0.95
    # services/conductor/planner.py; off: every instance keeps the role it was launched in.
    planner: Annotated[
        bool, Meta(description="move engine instances between prefill and decode as the load shifts (the planner)")
    ] = False
    planner_window_s: Annotated[
        float, Meta(description="the planner judges demand on the arrivals of this many seconds")
    ] = PLANNER_WINDOW_S
    planner_interval_s: Annotated[float, Meta(description="seconds between the planner's decisions")] = PLANNER_INTERVAL_S
    planner_confirm: Annotated[
        int, Meta(description="the planner's decisions in a row that must want the same move before it moves")
    ] = PLANNER_CONFIRM
    planner_dwell_s: Annotated[
        float, Meta(description="seconds an instance keeps a role the planner gave it, at least")
    ] = PLANNER_DWELL_S
    fair_share_mark: Annotated[
        float, Meta(description="with tenants: past this share of a request's SLOs, admission refuses sheddable "
                                "tenants and those over their fair share (docs/tenants.md)")
    ] = FAIR_SHARE_MARK
    shortlist: Annotated[int, Meta(description=SHORTLIST_DESCRIPTION)] = SHORTLIST
    # Several share the schedule requests (services/conductor/sync.py); one sends
    # its books' news to the others only where there are others.
    conductors: Annotated[
        int, Meta(description="Conductors sharing the schedule requests, each holding every placement's books")
    ] = 1
    # services/conductor/sync.py: the longest a peer is blind to a placement, against
    # the messages each Conductor reads per second from each peer.
    conductor_sync_ms: Annotated[
        float, Meta(description="with several Conductors: how often each sends the others what its books took in, ms")
    ] = 50.0
    index_capacity_blocks: Annotated[
        int, Meta(description="blocks the Conductor assumes each prefill engine's prefix cache holds")
    ] = 2048
    # KV transfer: shared memory on each node, ZeroMQ between nodes.
    kv_dir: Annotated[
        str, Meta(description="where each node's messenger puts its pool file and sockets (empty: under /dev/shm)")
    ] = ""
    pool_bytes: Annotated[int, Meta(description="each node's KV block pool, bytes")] = 512 << 20
    eviction: Annotated[str, Meta(description="node pools' eviction policy: lru or lfu")] = "lru"
    ssd_dir: Annotated[
        str, Meta(description="SSD tier: each node keeps DRAM-evicted blocks in DIR/<node> (empty: none)")
    ] = ""
    ssd_bytes: Annotated[int, Meta(description="SSD tier size per node, bytes")] = 0
    kv_wait_s: Annotated[
        float, Meta(description="how long decode waits for blocks still in transit before computing them, s")
    ] = 2.0
    # False is there for comparison (`yuebing bench ttft`).
    kv_stream_layers: Annotated[
        bool, Meta(description="send each layer as prefill computes it (off: send a block after its last layer)")
    ] = True
    # "tcp": sealed batches over plain TCP streams read and written by the messenger's own
    # loop (services/messenger/tcp_transport.py), the fastest here (`yuebing bench
    # transfer`). "zmq": the same batches over ZeroMQ, which also offers CURVE
    # (--kv-security curve). "mooncake": Mooncake's Transfer Engine moves the bytes (TCP,
    # RDMA where the NICs are), ZeroMQ only the sealed notes around them
    # (services/messenger/mooncake_transport.py).
    kv_transport: Annotated[
        str, Meta(description="how messengers move KV between nodes: tcp (plain TCP streams), zmq (ZeroMQ) "
                  "or mooncake (Transfer Engine)")
    ] = "tcp"
    # Off, every reuse goes through the node pools (what `yuebing bench reuse` measures).
    engine_prefix_caching: Annotated[bool, Meta(description="vLLM's own prefix cache in each engine")] = True
    # --- KV store: pin leases and bounded state (issue 16; services/messenger, services/conductor/index.py) ---
    # Engines renew their requests' pins several times a lease (at every step), so a
    # lease needs only outlast the longest engine step; a crashed engine's pins go after it.
    kv_pin_lease_s: Annotated[
        float, Meta(description="a pin on a pool block lapses this long after its engine last renewed it, s")
    ] = 30.0
    kv_peer_forget_s: Annotated[
        float, Meta(description="a peer messenger silent this long has its transfer socket closed, s")
    ] = 60.0
    ssd_queue_bytes: Annotated[
        int, Meta(description="spills waiting for the SSD writer, bytes at most (beyond: the spill is skipped)")
    ] = 256 << 20
    pool_index_node_blocks: Annotated[
        int, Meta(description="blocks the Conductor's pool index keeps per node at most (oldest forgotten first)")
    ] = 1 << 20
    # --- end of the KV store block ---
    # --- gateway: overload shedding and HTTP limits (issue 16; services/gateway/limits.py, server.py) ---
    # Beyond running + waiting, or after queue_timeout_s in the queue, a request is a 429 with Retry-After.
    gateway_max_running: Annotated[
        int, Meta(description="requests one gateway serves at once (tokenizing, waiting on the cluster, streaming)")
    ] = 512
    gateway_max_waiting: Annotated[
        int, Meta(description="requests one gateway queues for a serving slot; beyond them, a 429")
    ] = 512
    gateway_queue_timeout_s: Annotated[
        float, Meta(description="longest wait in the gateway's queue before a 429, s")
    ] = 10.0
    # Below a process's usual 1024 open files, so the cap answers before accept() fails.
    gateway_max_connections: Annotated[
        int, Meta(description="HTTP connections one gateway holds open; beyond them, a 503 and close")
    ] = 1000
    gateway_header_timeout_s: Annotated[
        float, Meta(description="longest time a client may take to send a request's headers, s")
    ] = 10.0
    gateway_body_timeout_s: Annotated[
        float, Meta(description="longest time a client may take to send a request's body, s (then a 408)")
    ] = 20.0
    gateway_keepalive_timeout_s: Annotated[
        float, Meta(description="how long an idle keep-alive connection stays open, s")
    ] = 15.0
    gateway_write_timeout_s: Annotated[
        float, Meta(description="longest wait for a client to take the next bytes of a response, s (then aborted)")
    ] = 10.0
    gateway_max_body_bytes: Annotated[
        int, Meta(description="largest request body the gateway reads, bytes (then a 413)")
    ] = 16 << 20
    # vLLM's parsers by the names `vllm serve --tool-call-parser` takes; naming one
    # also enables tool_choice "auto", as its --enable-auto-tool-choice does.
    tool_call_parser: Annotated[
        str, Meta(description="vLLM tool-call parser for this model (hermes, llama3_json, mistral, ...; "
                              "empty: requests with tool_choice other than none are refused)")
    ] = ""
    # Stored Responses (previous_response_id, GET /v1/responses/{id}) live in NATS
    # JetStream's key-value store, which every gateway reads: bounded in age and size.
    responses_ttl_s: Annotated[
        float, Meta(description="how long a stored Responses API response is kept, s")
    ] = 86400.0
    responses_max_bytes: Annotated[
        int, Meta(description="the stored responses' bound in all, bytes (the oldest go first)")
    ] = 256 << 20
    # --- end of the gateway block ---
    # Off by default: a collector must be named, and spans cost a little on every request.
    otlp_endpoint: Annotated[
        str, Meta(description="OTLP/HTTP collector every process sends its traces to, e.g. http://127.0.0.1:4318 "
                              "(empty: tracing off)")
    ] = ""
    otlp_sample: Annotated[
        float, Meta(description="share of requests traced, decided at the gateway (with otlp_endpoint)")
    ] = 1.0
    log_level: Annotated[str, Meta(description="log level of every service")] = "info"

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_planner()
        self._check_fairness()
        self._check_engine()
        self._check_times()
        self._check_store()
        self._check_gateway()

    def _check_sizes(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.step_tokens < self.block_size:
            raise ValueError(f"step_tokens must hold at least one block ({self.block_size}), got {self.step_tokens}")
        most = min(self.step_tokens, self.max_model_len)
        if self.decode_chunk_tokens and not self.block_size <= self.decode_chunk_tokens <= most:
            raise ValueError(f"decode_chunk_tokens must be 0 (sized to the TBT SLO) or from a block ({self.block_size}) "
                             f"to step_tokens and max_model_len ({most}), got {self.decode_chunk_tokens}")
        if self.shortlist < 0:
            raise ValueError("shortlist cannot be negative (0: every instance scored)")
        if self.conductors < 1:
            raise ValueError("conductors must be at least 1")
        if not 0 < self.conductor_sync_ms <= self.heartbeat_interval_s * 1e3:
            raise ValueError("conductor_sync_ms must be above 0 and at most the heartbeat interval")
        if self.fake_engine_step_ms < 0:
            raise ValueError("fake_engine_step_ms cannot be negative (0: the real engine)")
        if self.index_capacity_blocks <= 0:
            raise ValueError("index_capacity_blocks must be positive")
        if self.pool_bytes <= 0 or self.ssd_bytes < 0:
            raise ValueError("pool_bytes must be positive, ssd_bytes not negative")

    def _check_fairness(self) -> None:
        if not 0 < self.fair_share_mark <= 1:
            raise ValueError(f"fair_share_mark must be in (0, 1], got {self.fair_share_mark}")

    def _check_planner(self) -> None:
        if self.planner_window_s <= 0 or self.planner_interval_s <= 0 or self.planner_dwell_s < 0:
            raise ValueError("planner_window_s and planner_interval_s must be positive, planner_dwell_s not negative, "
                             f"got {self.planner_window_s}, {self.planner_interval_s}, {self.planner_dwell_s}")
        if self.planner_confirm < 1:
            raise ValueError(f"planner_confirm must be at least 1, got {self.planner_confirm}")
        if self.conductors > 1 and self.planner:
            raise ValueError("the planner moves instances from one Conductor: run it with conductors 1")
        if self.planner and self.mode not in PLANNER_MODES:
            raise ValueError(f"the planner moves instances between prefill and decode: mode {self.mode} has no roles "
                             "it may change (run it in adaptive or disaggregated mode)")

    def _check_engine(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (what vLLM takes), got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if min(self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size) < 1:
            raise ValueError("prefill_tensor_parallel_size and decode_tensor_parallel_size must be at least 1")
        # A pool block holds one part per (layer, rank): decode loads prefill's KV only
        # when both shard it alike (colocated, nothing moves between engines).
        if self.mode != "colocated" and self.prefill_tensor_parallel_size != self.decode_tensor_parallel_size:
            raise ValueError(f"prefill_tensor_parallel_size ({self.prefill_tensor_parallel_size}) and "
                             f"decode_tensor_parallel_size ({self.decode_tensor_parallel_size}) must be equal "
                             f"in {self.mode} mode: decode loads prefill's KV shard by shard")

    def _check_times(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_interval_s > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")
        if self.request_timeout_s <= 0 or self.schedule_timeout_s <= 0 or self.token_idle_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.slo_ttft_ms < 0 or self.slo_tbt_ms < 0 or self.decode_time_s <= 0:
            raise ValueError("SLOs must not be negative (0: from the profile), decode_time_s must be positive")
        if self.kv_wait_s < 0:
            raise ValueError("kv_wait_s must not be negative")
        if not 0.5 <= self.slo_attainment < 1:
            raise ValueError("slo_attainment must be at least 0.5 and below 1")
        if self.max_attempts < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("max_attempts must be at least 1 and prefill_timeout_s positive")

    def _check_gateway(self) -> None:
        if self.otlp_endpoint and not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?",
                                                   self.otlp_endpoint):
            raise ValueError(f"otlp_endpoint must be an http(s) URL, e.g. http://127.0.0.1:4318, got {self.otlp_endpoint!r}")
        if not 0 <= self.otlp_sample <= 1:
            raise ValueError(f"otlp_sample must be a share from 0 to 1, got {self.otlp_sample}")
        if not re.fullmatch(r"[a-z0-9_]{0,64}", self.tool_call_parser):
            raise ValueError(f"tool_call_parser must be a vLLM tool parser's name, got {self.tool_call_parser!r}")
        counts = (self.gateway_max_running, self.gateway_max_connections, self.gateway_max_body_bytes)
        if min(counts) <= 0 or self.gateway_max_waiting < 0:
            raise ValueError("gateway_max_running, _max_connections and _max_body_bytes must be positive, "
                             "gateway_max_waiting not negative")
        times = (self.gateway_queue_timeout_s, self.gateway_header_timeout_s, self.gateway_body_timeout_s,
                 self.gateway_keepalive_timeout_s, self.gateway_write_timeout_s)
        if min(times) <= 0:
            raise ValueError("the gateway's timeouts must be positive")
        if self.responses_ttl_s <= 0 or self.responses_max_bytes < 1 << 20:
            raise ValueError("responses_ttl_s must be positive and responses_max_bytes at least 1 MiB")

    def _check_store(self) -> None:
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be lru or lfu, got {self.eviction!r}")
        if self.kv_pin_lease_s < 1.0 or self.kv_peer_forget_s <= self.liveness_timeout_s:
            raise ValueError("kv_pin_lease_s must be at least 1 s (engines renew about every second), "
                             "kv_peer_forget_s must exceed liveness_timeout_s")
        if self.ssd_queue_bytes <= 0 or self.pool_index_node_blocks <= 0:
            raise ValueError("ssd_queue_bytes and pool_index_node_blocks must be positive")

    def tensor_parallel_size(self, role: str) -> int:
        """GPUs one engine of `role` ("prefill" or "decode") shards the model over."""
        return self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size

    def prompt_chunk_tokens(self, role: str) -> int:
        """One prompt's tokens per step at the most on an engine of `role` (0: the
        step's budget). Decode engines cap it, so that a prompt spilled onto one costs
        its streams no step over the TBT SLO; prefill engines serve their queue whole
        prompt after whole prompt, and colocated engines chunk as vLLM does by default.
        An engine launched for prefill takes the decode cap while it decodes
        (shared/kv/chunk_cap.py)."""
        return self.decode_chunk_tokens if role == "decode" and self.mode != "colocated" else 0

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name

    @property
    def kv_root(self) -> str:
        return self.kv_dir or f"/dev/shm/yuebing-{os.getuid()}"

    @property
    def model_salt(self) -> bytes:
        """Folded into block hashes so that two models (or two sets of weights under one
        name) never share a block name."""
        return self.served_model_name.encode() + b"\0" + self.model_fingerprint.encode()

    @property
    def model_identity(self) -> str:
        """The model as pool and SSD headers name it: new weights under an old name never
        reuse its KV."""
        return f"{self.served_model_name}@{self.model_fingerprint[:16]}"


DEFAULT_PROFILE = Path(__file__).with_name("profiles") / "yuebing-tiny-cpu.json"


def profile_path(config: ClusterConfig) -> Path:
    return Path(config.profile) if config.profile else DEFAULT_PROFILE


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    try:
        return msgspec.json.decode(raw, type=ClusterConfig)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"invalid config {path}: {e}") from e


def save_config(config: ClusterConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(config), indent=2))


def check_id(value: str, what: str = "id") -> str:
    """Instance and node ids become NATS subject tokens: keep them to a safe alphabet."""
    if not ID_PATTERN.match(value):
        raise ValueError(f"{what} {value!r} must match {ID_PATTERN.pattern}")
    return value
