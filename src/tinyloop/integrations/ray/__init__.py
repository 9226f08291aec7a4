"""Ray integration (the 'ray' extra): batch tasks over Ray Data (TinyLoopPredictor, run_ray_job) and the
OpenAI server as a Ray Serve deployment (serve_application). Importing this package does not import ray."""

from tinyloop.integrations.ray.data import TinyLoopPredictor, run_ray_job
from tinyloop.integrations.ray.serving import serve_application

__all__ = ["TinyLoopPredictor", "run_ray_job", "serve_application"]
