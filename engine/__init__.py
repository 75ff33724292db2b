"""Training engine: the recipe and the interface of its pipelines (trainer.py), one module per
pipeline (single_gpu.py, gaussian_exchange.py), the model, the densification strategies and
the snapshots that resume a run."""
