"""Runnable examples: ``python -m redfuser.examples.models`` fuses three small real models
(GPT-2 block, Llama block, Mixtral router) and compares them with PyTorch."""
