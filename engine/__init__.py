"""Training engine: the trainer loop and its snapshot/resume support."""
