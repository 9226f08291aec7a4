"""The OpenAI server (tinyloop.serve's FastAPI app) as a Ray Serve deployment: every replica loads the
model once and serves the same API; requests are spread over replicas, optionally autoscaled on the
number of requests each replica has in flight."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from tinyloop.api.model import Model


def serve_application(
    model: str,
    *,
    replicas: int = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    autoscale: bool = False,
    min_replicas: int = 1,
    target_ongoing_requests: float | None = None,
    model_options: Mapping[str, Any] | None = None,
    **app_options: Any,
) -> Any:
    """A bound Ray Serve application for `serve.run(...)`.

    replicas: fixed replicas, or with autoscale=True the most (from min_replicas, scaled so each replica
    has about target_ongoing_requests in flight; default: its max_batch). num_gpus / num_cpus: per
    replica. app_options go to tinyloop.serve.create_app (served_model_name, max_batch, max_queue, warm_up,
    ...): with warm_up a replica answers GET /health 200 only once its scheduler has warmed up."""
    from ray import serve

    from tinyloop.serve.app import create_app

    app = create_app(functools.partial(Model, model, **dict(model_options or {})), **app_options)
    max_batch = int(app_options.get("max_batch", 8))
    scaling: dict[str, Any]
    if autoscale:
        target = max_batch if target_ongoing_requests is None else target_ongoing_requests
        scaling = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": replicas,
                                          "target_ongoing_requests": target}}  # fmt: skip
    else:
        scaling = {"num_replicas": replicas}

    # A replica takes more requests than it decodes at once: the scheduler queues them (its own queue
    # answers 503 when full), so a batch is ready as soon as a row frees.
    @serve.deployment(ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
                      max_ongoing_requests=4 * max_batch, **scaling)  # fmt: skip
    @serve.ingress(app)
    class TinyLoopServer:
        pass

    return TinyLoopServer.bind()  # type: ignore[attr-defined]
