"""The benchmarks behind `yuebing bench ...` (commands/bench_*.py parse their flags):

- `conductor`: the Conductor's decision path, in-process;
- `hash`: the block hash's digest, sha256 against xxh3-128, in-process;
- `transfer`: messenger → messenger KV block throughput against memcpy, and each
  messenger's CPU per GB;
- `connector`: the KV connector's copies against a LLaMA-shaped forward, CPU or
  GPU, without vLLM (its settings in `connector_config`);
- `ttft`: a long prompt's TTFT colocated vs disaggregated, live;
- `reuse`: TTFT with part of the prompt in the node pools, live.

Each has a `run(...)` returning results, a `table(...)` to print and a `to_json(...)`.
The live ones talk to servers through yuebing/client.py and start them through
yuebing/process.py. Trace replay and the simulator's fidelity are yuebing/lab's.
"""
