"""The router's Prometheus text on `--metrics-port`: its own families, then each loaded
model's (the families a single-model server exposes), one series per model labelled
`model="NAME"`, so one scrape job covers every model. `GET /metrics?model=NAME` on the main
port still answers for one model, unlabelled, as llama-server's router does.
"""

from __future__ import annotations

from mlxcel.server.ops.metrics import Family, collect, render, render_labelled
from mlxcel.server.router.pool import ModelPool, ModelStatus


def router_families(pool: ModelPool) -> list[Family]:
    """The router's own families: its models by status, and what the pool has done."""
    statuses = [m.status for m in pool.models]
    counters = pool.counters
    return [
        Family("mlxcel_router_models", "gauge", "Models the router can serve", len(statuses)),
        Family(
            "mlxcel_router_models_loaded",
            "gauge",
            "Models loaded (sleeping ones included)",
            sum(s in (ModelStatus.LOADED, ModelStatus.SLEEPING) for s in statuses),
        ),
        Family(
            "mlxcel_router_models_loading",
            "gauge",
            "Models loading now",
            statuses.count(ModelStatus.LOADING),
        ),
        Family("mlxcel_router_loads_total", "counter", "Model loads that worked", counters.loads),
        Family(
            "mlxcel_router_load_failures_total",
            "counter",
            "Model loads that failed or were refused (no room)",
            counters.load_failures,
        ),
        Family(
            "mlxcel_router_evictions_total",
            "counter",
            "Models unloaded to make room for another (--models-max, memory)",
            counters.evictions,
        ),
        Family(
            "mlxcel_router_unloads_total",
            "counter",
            "Models unloaded on request (POST /models/unload, a reload)",
            counters.unloads,
        ),
    ]


def router_metrics_text(pool: ModelPool) -> str:
    """The `--metrics-port` body of a router server."""
    status = {
        m.entry.name: [
            Family(
                "mlxcel_router_model_loaded",
                "gauge",
                "1 while the model is loaded (sleeping included), else 0",
                m.status in (ModelStatus.LOADED, ModelStatus.SLEEPING),
            )
        ]
        for m in pool.models
    }
    loaded = {
        m.entry.name: collect(service.state)
        for m in list(pool.models)
        if (service := m.service) is not None
    }
    parts = [render(router_families(pool)), render_labelled("model", status)]
    if loaded:
        parts.append(render_labelled("model", loaded))
    return "\n".join(parts)
