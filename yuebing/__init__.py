"""The `yuebing` command and what it runs outside the services.

- `cli`: the entry point; builds its parser from `commands/`, one module per
  command (the protocol is in `commands/__init__.py`).
- `launcher`: `yuebing up`, the local cluster as supervised child processes.
- `process`: the one way to start and stop a child process (own process group, log
  file, dies with its parent, SIGTERM then SIGKILL).
- `client`: the one streaming client of the OpenAI-compatible API.
- `flags`: command-line flags generated from settings classes.
- `progress`: progress bars on a terminal only.
- `model`: the default dummy model's writer; `profile`: the engine's time models.
- `bench/`: the benchmarks of `yuebing bench` (conductor, transfer, ttft, reuse).
- `lab/`: the simulator, traces, trace replay and the simulator's fidelity check.
"""
