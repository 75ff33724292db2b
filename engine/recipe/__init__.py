"""The recipe: what training is, whatever the hardware. The trainer's loop and its step body
(``trainer``), the model (``model``), the densification strategies (``strategy``), and what they
draw on: the colour corrections, the targets, the view order, pruning and BlitzGS's workload cuts."""
