"""The HTTP layer: the app factory, routes, dependencies, response models, dashboard, /metrics, /docs."""
