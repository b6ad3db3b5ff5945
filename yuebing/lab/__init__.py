"""The lab: where Yuebing is measured and modelled, apart from the serving path.

- `trace`: request traces (Mooncake's format, synthetic ones, rescaling);
- `outcome`: one request's outcome and the summary every run reports;
- `sim_config`: what the simulator simulates (`SimConfig`, `HostSharing`);
- `sim`: the discrete-event simulator of a cluster (`yuebing sim`);
- `replay`: a trace replayed against a live gateway (`yuebing bench replay`);
- `gaps`: a live run's decode gaps read against the simulator's step model;
- `calibration`: how the live instances share their host, for the simulator;
- `fidelity`: the same trace live and simulated (`yuebing bench fidelity`);
- `plots`: PNG plots of either;
- `data`: the shipped GPU profile and conversation trace.
"""
