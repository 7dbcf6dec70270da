"""Pipeline parallelism: the model cut into stages (and virtual stages), run by the schedules of
`orangetron.spec.schedule` with point-to-point transfers between neighbouring stages."""

from orangetron.parallel.pipeline.executor import MicroBatch, run_pipeline
from orangetron.parallel.pipeline.stage import Chunk, check_pipeline, split_stages

__all__ = ["Chunk", "MicroBatch", "check_pipeline", "run_pipeline", "split_stages"]
