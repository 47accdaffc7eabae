"""Recipes built on hf_lowzero's layers: the causal-LM fine-tune's model and data (``clm.py``, the
Trainer alone) and its job on Ray (``clm_ray/``). The layers below never import a recipe."""
