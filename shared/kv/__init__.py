"""KV plumbing between a node's vLLM engines and its messenger.

- `pool_file`: the node pool's shared memory and its slot layout;
- `wire`: what engines and messengers say to each other, and where;
- `leading`: counting the leading run of a prompt's blocks held somewhere;
- `client`: the engine's side of the wire (calls, notes, the followed pool);
- `plan`: what the connector's scheduler half decides, as plain functions;
- `chunk_cap`: the cap on a prompt's chunk per step, set by the decode work on an engine;
- `copier`: the worker half's copies between layer caches and the pool, off the
  forward path (torch, no vLLM: `yuebing bench connector` drives it alone);
- `connector` (vLLM's entry point), `scheduler`, `worker`, `meta`, `options`: the
  vLLM KV connector. Only these and `copier` import vLLM or torch; the messenger
  imports none.
"""
