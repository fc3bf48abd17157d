"""Entry points for training frameworks; each imports its framework lazily (an optional extra).

- :mod:`remat.integrations.hf`: HuggingFace transformers and PEFT (``pip install 'remat[hf]'``).
"""
