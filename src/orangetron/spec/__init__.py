"""The spec layer: what the runtime, the planner and the CLI share, with no torch.

| module | holds |
|---|---|
| `layout` | `Layout`: degrees, rank <-> coordinates |
| `model` | `ModelSpec`, the model schema, and the shipped model presets |
| `parallel_config` | `ParallelConfig`: the parallel options runtime and planner share (`ot.ParallelConfig`) |
| `options` | `Job`: a `ParallelConfig` plus what only the planner prices (what changes memory, traffic, time) |
| `hardware` | GPU presets and the cluster they form |
| `collectives` | the bytes each collective moves (`CommRecord`), for the ledger and the cost model alike |
| `sharding` | how a flat buffer, a bucket or a token range splits over ranks |
| `stages` | which layers each pipeline stage and virtual chunk holds |
| `schedule` | each pipeline schedule's order of forward and backward actions |
| `categories` | the memory categories a rank keeps |

Nothing here imports torch, `orangetron.plan` or the runtime (tests/test_architecture.py scans for it).
"""
