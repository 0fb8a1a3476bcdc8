"""Rule-based scorers, one module per task family; routed by `tiller.rewards.registry`."""
