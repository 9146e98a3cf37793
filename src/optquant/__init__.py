"""optquant: how the choice of optimizer changes a language model's robustness to quantization.

A reproduction and extension of "Beyond Outliers: A Study of Optimizers Under Quantization"
(Vlassis, Ashkboos, Volkova, Hoefler, Alistarh; arXiv 2509.23500). Reading order: model.py →
train.py → optim/__init__.py → quant/__init__.py → metrics/ → study/.
"""

__version__ = "0.1.0"
